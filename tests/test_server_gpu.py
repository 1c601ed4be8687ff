"""`lily serve` on a CUDA GPU with the fast backend (skipped without one): a real server process on
the tiny checkpoint, checked against the fast backend's own device-side greedy loop in this process."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fast backend)")]

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-gpu"
NO_EOS = {"499": -100, "500": -100}
EOS = (499, 500)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lily.synthetic import make_synthetic
    return make_synthetic("tiny", tmp_path_factory.mktemp("gpu") / "ckpt", seed=5)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("log") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--model", str(ckpt), "--port", str(port),
                                 "--device", "cuda", "--backend", "fast", "--max-seq", "2048",
                                 "--served-model-name", MODEL], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    yield base
    proc.terminate()
    proc.wait(30)
    print(log.read_text()[-2000:])


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def fast(ckpt):
    from lily.engine import load_backend
    from lily.tokenizer import Tokenizer
    return load_backend(ckpt, "cuda", "fast", max_seq=2048), Tokenizer.from_dir(ckpt)


def test_greedy_completion_matches_the_device_loop(client, fast):
    backend, tok = fast
    prompt = torch.randint(0, 498, (40,)).tolist()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=1)
    want = backend.generate_greedy(prompt, 32, stop_ids=EOS)
    want = want[: next((i for i, t in enumerate(want) if t in EOS), len(want))]
    assert r.choices[0].text == tok.decode(want)
    assert r.usage.completion_tokens == len(want)
    assert all(lp <= 0 for lp in r.choices[0].logprobs.token_logprobs)


def test_stream_seed_and_follow_up_cache(client, fast):
    backend, tok = fast
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story about a robot."}], max_tokens=24,
              temperature=0.8, top_p=0.9, seed=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    streamed = list(client.chat.completions.create(stream=True, **kw))
    assert a.choices[0].message == b.choices[0].message
    text = "".join((getattr(c.choices[0].delta, "reasoning_content", None) or "") + (c.choices[0].delta.content or "")
                   for c in streamed if c.choices)
    m = a.choices[0].message
    assert text.replace("</think>", "").replace("\n", "") == ((m.reasoning_content or "") + (m.content or "")).replace("\n", "")

    first = [{"role": "user", "content": "What is the weather like today?"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    follow = first + [{"role": "assistant", "content": r1.choices[0].message.content or ""},
                      {"role": "user", "content": "And tomorrow?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=16, temperature=0,
                                        extra_body={"logit_bias": NO_EOS})
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    ids = tok.encode(tok.render_chat(follow))
    cold = backend.generate_greedy(ids, 16)  # a cold run in this process, on the device
    k = next((i for i, t in enumerate(cold) if t in EOS), len(cold))  # the server banned eos; compare up to it

    def norm(t):
        return t.replace("</think>", "").replace("\n", "")
    m2 = r2.choices[0].message
    assert norm((m2.reasoning_content or "") + (m2.content or "")).startswith(norm(tok.decode(cold[:k])))


def test_decode_speed_is_reported(client, server):
    import httpx

    t0 = time.perf_counter()
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=512, temperature=0,
                                  logit_bias=NO_EOS)
    wall = time.perf_counter() - t0
    assert r.usage.completion_tokens == 512
    text = httpx.get(server + "/metrics").text
    tps = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("lily_decode_tokens_per_second")))
    print(f"server decode {tps:.0f} tok/s (engine), {512 / wall:.0f} tok/s end to end")
    assert tps > 50


def test_prompt_scoring_on_the_fast_backend_matches_its_own_logits(client, fast):
    """echo + logprobs on the GPU server: each prompt token's log-probability is the fast backend's own
    all-positions prefill in this process, across more than one 256-position piece."""
    import random

    backend, _ = fast
    prompt = [random.randrange(498) for _ in range(300)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    got = r.choices[0].logprobs.token_logprobs
    logp = torch.log_softmax(backend.prefill_logits(prompt, backend.new_state()).float(), -1)
    want = [float(logp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert got[0] is None and len(got) == len(prompt)
    assert max(abs(a - b) for a, b in zip(got[1:], want)) < 0.05  # same kernels; pieces vs one run


def host_greedy(backend, prompt, n, allowed=None):
    """The fast backend's greedy tokens by its host-side prefill / decode (end-of-text ignored), each pick
    limited to `allowed` when given: the oracle for the server's per-request token limits."""
    state = backend.new_state()
    logits = backend.prefill(list(prompt), state)
    out = []
    while len(out) < n:
        row = logits.float().flatten().clone()
        if allowed is not None:
            keep = torch.full_like(row, float("-inf"))
            keep[list(allowed)] = 0
            row += keep
        out.append(int(torch.argmax(row)))
        logits = backend.decode(out[-1], state)
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_stop_and_allowed_token_ids_on_the_device_paths(client, fast, n):
    """vLLM's stop_token_ids end a greedy run before the token on the device-side paths (a lone request's
    run-ahead, n choices on the batched step), and allowed_token_ids limit every pick, as the fast backend's
    own host loop says."""
    import random

    backend, tok = fast
    prompt = [random.randrange(498) for _ in range(random.randrange(5, 40))]
    want = backend.generate_greedy(prompt, 24)
    k = random.randrange(len(want))
    cut = want.index(want[k])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, n=n,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [want[k]]})
    assert [(c.text, c.finish_reason) for c in r.choices] == [(tok.decode(want[:cut]), "stop")] * n
    assert r.usage.completion_tokens == cut * n

    allowed = random.sample(range(498), random.randrange(2, 8))
    expected = host_greedy(backend, prompt, 12, allowed)
    assert set(expected) <= set(allowed)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, n=n,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert [(c.text, c.finish_reason) for c in r.choices] == [(tok.decode(expected), "length")] * n
