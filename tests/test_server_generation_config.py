"""The checkpoint's generation_config.json as the sampling defaults (vLLM's `--generation-config auto`): a
request that leaves a field out samples with the file's value, one that sets it samples with its own;
`--generation-config none` and a checkpoint without the file give lily's built-in defaults; a file lily cannot
use stops `lily serve` (and `lily check`) at start-up with one line naming the file and the key.

Oracles: the same request with temperature 0 (the file's top_k 1 is greedy), and the same seeded request with
the values spelled out, against a real `lily serve` through the official openai client; in-process, a
stand-in backend's logits."""

import json
import random

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from helpers_standin import HistoryBackend
from lily.cli import main
from lily.demo_tokenizer import write_tokenizer_files
from lily.engine.sampling import Sampler
from lily.server.app import ServerSettings, create_app
from lily.server.generation_config import SamplingDefaults, read_generation_config
from lily.server.generations import sampling_params
from lily.server.protocol import ChatCompletionRequest
from lily.synthetic import make_synthetic
from lily.tokenizer import Tokenizer
from test_reliability_support import LilyServer

MODEL = "tiny"
NO_EOS = {"499": -100, "500": -100}  # the random model would otherwise end at random
# top_k 1: whatever the temperature, a request that leaves top_k out picks the best token
GEN = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 1, "eos_token_id": [500, 499]}
FILE_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0}
BUILT_IN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def words(k: int = 4) -> str:
    return " ".join(random.choice(["red", "blue", "cat", "sea", "old", "sun", "tree", "wind"]) for _ in range(k)) \
        + f" {random.randrange(10 ** 6)}"


# -- against `lily serve`, through the openai client ----------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = make_synthetic("tiny", tmp_path_factory.mktemp("genconfig") / "ckpt", seed=random.randrange(1000))
    (out / "generation_config.json").write_text(json.dumps(GEN))
    return out


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    """The same checkpoint served twice: with its generation config (the default, auto) and without (none)."""
    logs = tmp_path_factory.mktemp("log")
    with LilyServer(ckpt, "--served-model-name", MODEL, "--max-seq", "512", log_path=logs / "auto.log") as auto, \
            LilyServer(ckpt, "--served-model-name", MODEL, "--max-seq", "512", "--generation-config", "none",
                       log_path=logs / "none.log") as none:
        yield auto, none


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, text, **kw):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12,
                                       reasoning_effort="none", logit_bias=NO_EOS, **kw)
    assert r.usage.completion_tokens == 12
    return r.choices[0].message.model_dump()


def test_a_request_that_leaves_sampling_out_samples_with_the_checkpoint_s_values(servers):
    """The file's top_k 1 makes every endpoint's default greedy: the same text as temperature 0 (fresh random
    prompts); without the file (none) the same requests sample at temperature 1 and wander off it."""
    auto, none = servers
    client, plain = client_of(auto), client_of(none)
    wandered = 0
    for _ in range(3):
        text = words()
        greedy = chat(client, text, temperature=0)
        assert chat(client, text) == greedy
        wandered += chat(plain, text) != greedy
        prompt = words(6)
        kw = dict(model=MODEL, prompt=prompt, max_tokens=12, logit_bias=NO_EOS)
        assert client.completions.create(**kw).choices[0].text == \
            client.completions.create(temperature=0, **kw).choices[0].text
        kw = dict(model=MODEL, input=words(), max_output_tokens=12, reasoning={"effort": "none"})
        r = client.responses.create(**kw)
        assert r.output_text == client.responses.create(temperature=0, **kw).output_text
        assert (r.temperature, r.top_p) == (0.7, 0.9)  # what it sampled with, as vLLM reports it
    assert wandered, "three 12-token answers at temperature 1 all equal to the greedy ones"


def test_fields_a_request_sets_win_over_the_file(servers):
    """Seeded, so each answer is a function of its sampling values: a request that sets a field on the `auto`
    server answers what the `none` server answers with every value spelled out, the file's for the fields it
    leaves out."""
    auto, none = servers
    client, plain = client_of(auto), client_of(none)
    for _ in range(2):
        text, seed = words(), random.randrange(1 << 30)
        # every field set: the file has no say
        mine = chat(client, text, seed=seed, temperature=1.0, top_p=1.0, extra_body={"top_k": -1})
        assert mine == chat(plain, text, seed=seed)
        # top_k alone set (off): temperature and top_p still the file's
        mine = chat(client, text, seed=seed, extra_body={"top_k": 0})
        assert mine == chat(plain, text, seed=seed, temperature=0.7, top_p=0.9)
    greedy = chat(client, text, temperature=0)
    assert any(chat(client, text, seed=s, extra_body={"top_k": 0}) != greedy for s in range(4)), \
        "overriding top_k never sampled off the greedy answer"


def test_the_defaults_in_effect_are_logged_and_shown_on_the_model(servers, ckpt):
    auto, none = servers
    for server, want in ((auto, FILE_DEFAULTS), (none, BUILT_IN)):
        card = client_of(server).models.retrieve(MODEL)
        assert card.model_extra["default_sampling_params"] == want
    line = [x for x in auto.log().splitlines() if "sampling defaults" in x]
    assert len(line) == 1 and str(ckpt / "generation_config.json") in line[0] and "top_k 1" in line[0]
    line = [x for x in none.log().splitlines() if "sampling defaults" in x]
    assert len(line) == 1 and "--generation-config none" in line[0] and "temperature 1.0" in line[0]


def test_help_names_the_switch(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--generation-config {auto,none}" in out and "generation_config.json" in out


# -- a file lily cannot use: one line at start-up ---------------------------------------------------------------
@pytest.fixture(scope="module")
def bare_ckpt(tmp_path_factory):
    return make_synthetic("tiny", tmp_path_factory.mktemp("bad") / "ckpt", seed=random.randrange(1000))


@pytest.mark.parametrize("text,needle", [
    ('{"temperature": 0.6,', "not valid JSON"),
    ('[0.6, 0.95]', "holds a JSON list, not an object"),
    ('{"temperature": "0.6"}', 'temperature "0.6" cannot be a request\'s default (Input should be a valid number)'),
    ('{"temperature": 2.5}', "temperature 2.5 cannot be a request's default (Input should be less than or equal to 2)"),
    ('{"top_p": 0}', "top_p 0 cannot be a request's default (Input should be greater than 0)"),
    ('{"top_k": 20.5}', "top_k 20.5 cannot be a request's default"),
    ('{"min_p": 1.5}', "min_p 1.5 cannot be a request's default"),
    ('{"repetition_penalty": 0}', "repetition_penalty 0 cannot be a request's default"),
    ('{"max_new_tokens": 0}', "max_new_tokens 0 cannot be a request's default"),
])
def test_a_file_lily_cannot_use_stops_serve_and_check_with_one_line(bare_ckpt, text, needle, capsys):
    path = bare_ckpt / "generation_config.json"
    path.write_text(text)
    # check first: it returns where a serve that accepted the file would go on serving
    for argv in (["check", str(bare_ckpt)], ["serve", "--model", str(bare_ckpt), "--port", "0", "--device", "cpu"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err and needle in err, err
        assert "--generation-config none" in err
    # none: the file is not read at all
    assert read_generation_config(bare_ckpt, "none")[0] == SamplingDefaults()


def test_unset_keys_and_do_sample(tmp_path):
    """null is unset (transformers' own 'unset'); keys that are not sampling defaults are ignored; do_sample
    false is ignored as vLLM ignores it, and said so; top_k -1 is off, as 0."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": None, "top_k": -1, "top_p": 0.5, "max_length": 20, "eos_token_id": 1,
         "presence_penalty": 1.0, "max_new_tokens": 7}))
    defaults, notes = read_generation_config(tmp_path)
    assert defaults.params() == {**BUILT_IN, "top_p": 0.5, "max_tokens": 7}
    assert len(notes) == 1 and "do_sample false" in notes[0]
    assert read_generation_config(tmp_path / "nothing-here")[0].params() == BUILT_IN


# -- in-process, over a stand-in backend -----------------------------------------------------------------------
V = 508


class RandomBackend(HistoryBackend):
    """Logits from the whole history, fresh each run (a random offset), the same for the same history."""

    def __init__(self):
        self.salt = random.randrange(1 << 30)

    def _logits(self, s):
        g = torch.Generator().manual_seed(hash((self.salt, *s)) % 2 ** 31)
        x = torch.randn(V, generator=g) * 2
        x[499:502] = -30  # no end of text: every answer is max_tokens long
        return x


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(write_tokenizer_files(tmp_path_factory.mktemp("tok")))


def app_for(tokenizer, model_dir, mode="auto", max_seq=128):
    defaults, _ = read_generation_config(model_dir, mode)
    app = create_app(RandomBackend(), tokenizer,
                     ServerSettings(model_name=MODEL, max_seq=max_seq, sampling_defaults=defaults))
    return TestClient(app, raise_server_exceptions=False)


def post_chat(client, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": words()}], "reasoning_effort": "none", **kw}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_checkpoint_without_the_file_keeps_the_built_in_defaults(tmp_path, tokenizer):
    with app_for(tokenizer, tmp_path) as client:
        assert client.get(f"/v1/models/{MODEL}").json()["default_sampling_params"] == BUILT_IN
        text, seed = words(), random.randrange(1 << 30)
        msgs = [{"role": "user", "content": text}]
        left_out = post_chat(client, messages=msgs, seed=seed, max_tokens=10)
        spelled = post_chat(client, messages=msgs, seed=seed, max_tokens=10, temperature=1.0, top_p=1.0, top_k=-1,
                            min_p=0.0, repetition_penalty=1.0)
        assert left_out["choices"][0]["message"] == spelled["choices"][0]["message"]
        usage = post_chat(client)["usage"]  # no max_tokens: what the context leaves
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128


def test_max_new_tokens_is_chat_s_and_responses_default_max_tokens(tmp_path, tokenizer):
    """As vLLM's get_max_tokens: the file's max_new_tokens caps a chat or responses request that gives no
    max_tokens (and what the context leaves caps it); a request's own max_tokens wins; completions keep 16."""
    n = random.randrange(3, 12)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": n}))
    with app_for(tokenizer, tmp_path) as client:
        r = post_chat(client)
        assert r["usage"]["completion_tokens"] == n and r["choices"][0]["finish_reason"] == "length"
        assert post_chat(client, max_tokens=n + 3)["usage"]["completion_tokens"] == n + 3
        r = client.post("/v1/responses", json={"model": MODEL, "input": words(), "reasoning": {"effort": "none"}})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == n
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": words()})
        assert r.json()["usage"]["completion_tokens"] == 16
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 10 ** 6}))
    with app_for(tokenizer, tmp_path) as client:
        r = post_chat(client)  # more than the context holds: what the context leaves, no error
        assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 128


@pytest.mark.parametrize("gen,on_device", [
    ({"temperature": 1.0, "top_p": 0.95, "top_k": 20}, True),     # the synthetic checkpoints' (Qwen's kind)
    ({"temperature": 0.6, "top_k": 1024, "min_p": 0.05}, True),   # the device kernels' largest top_k
    ({"top_k": 1}, True),
    ({"temperature": 0.7, "repetition_penalty": 1.1}, False),     # a penalty is applied on the host
])
def test_defaults_keep_the_device_draw(tmp_path, tokenizer, gen, on_device):
    """Defaults become the same SamplingParams a request's own values would: the worker draws them on the
    device where it would draw those (lily.kernels.sample), the host path only for a repetition penalty."""
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    defaults, _ = read_generation_config(tmp_path)
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    params = sampling_params(tokenizer, body, False, 0, defaults)
    spelled = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    **gen})
    assert params == sampling_params(tokenizer, spelled, False, 0)
    assert Sampler(params, V, "cpu", [1, 2]).picks_on_device == on_device


def test_a_request_s_own_zeros_and_ones_win(tmp_path, tokenizer):
    """A request that turns a knob off (temperature 0, top_k 0 or -1, min_p 0, repetition_penalty 1) gets it
    off, not the file's value: set is set, whatever the value."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.9, "top_p": 0.8, "top_k": 5, "min_p": 0.2, "repetition_penalty": 1.3}))
    defaults, _ = read_generation_config(tmp_path)
    for top_k in (0, -1):
        body = ChatCompletionRequest.model_validate({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_p": 1.0,
            "top_k": top_k, "min_p": 0, "repetition_penalty": 1.0})
        params = sampling_params(tokenizer, body, False, 0, defaults)
        assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
            (0.0, 1.0, 0, 0.0, 1.0)
