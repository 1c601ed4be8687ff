"""PrefixCache: strict-prefix reuse, a whole prompt's reuse with its stored logits, key preference, LRU and memory
budget, private copies; and a generation that reuses a cached state gives exactly the tokens of a cold run."""

import random

import torch

from lily.engine.generation import GenerationRequest, generate
from lily.engine.prefix_cache import PrefixCache
from lily.engine.sampling import SamplingParams


def make_cache(entries=4, budget=1 << 20):
    return PrefixCache(entries, budget, clone=lambda s: {"t": s["t"].clone()}, nbytes=lambda s: s["t"].numel() * 4)


def state_of(tokens):
    return {"t": torch.tensor(tokens, dtype=torch.float32)}


def rand_tokens(n):
    return [random.randrange(1000) for _ in range(n)]


def test_strict_prefix_only_and_longest_wins():
    c = make_cache()
    a = rand_tokens(6)
    c.insert(a[:3], state_of(a[:3]))
    c.insert(a, state_of(a))
    n, st, logits = c.lookup(a + [7])
    assert n == 6 and st["t"].tolist() == a and logits is None
    n, st, logits = c.lookup(a)          # equal, not strict, and no logits stored: falls back to the shorter entry
    assert n == 3 and st["t"].tolist() == a[:3] and logits is None
    assert c.lookup(rand_tokens(1) + a) == (0, None, None)
    assert c.stats.hits == 2 and c.stats.misses == 1 and c.stats.cached_tokens == 9


def test_whole_prompt_with_its_logits_is_a_hit_and_a_private_copy():
    c = make_cache()
    a = rand_tokens(5)
    c.insert(a[:2], state_of(a[:2]))
    c.insert(a, state_of(a))
    live = torch.randn(30)
    want = live.clone()
    c.insert(a, state_of(a), logits=live)   # the same tokens again, now with the logits after them
    live.fill_(float("nan"))
    n, st, logits = c.lookup(a)
    assert n == 5 and st["t"].tolist() == a and torch.equal(logits, want)
    logits.fill_(-1)                        # the sampler may change its copy in place
    assert torch.equal(c.lookup(a)[2], want)
    n, st, logits = c.lookup(a + [3])       # a longer prompt runs on from the state; the logits are not its
    assert n == 5 and logits is None
    assert c.nbytes == 2 * 4 + 5 * 4 + 30 * 4
    n, st, logits = c.lookup(a[:4])
    assert n == 2 and st["t"].tolist() == a[:2] and logits is None


def test_matching_cache_key_preferred_over_longer():
    c = make_cache()
    a = rand_tokens(8)
    c.insert(a[:2], state_of(a[:2]), key="alice")
    c.insert(a[:5], state_of(a[:5]), key="bob")
    assert c.lookup(a, key="alice")[0] == 2
    assert c.lookup(a, key="carol")[0] == 5
    assert c.lookup(a)[0] == 5


def test_lookup_returns_a_private_copy_and_insert_snapshots():
    c = make_cache()
    a = rand_tokens(4)
    live = state_of(a)
    c.insert(a, live)
    live["t"].fill_(float("nan"))  # the caller keeps mutating its state: the entry must not change
    _, st, _ = c.lookup(a + [1])
    st["t"].fill_(-1)
    _, st2, _ = c.lookup(a + [1])
    assert st2["t"].tolist() == a


def test_lru_and_memory_budget():
    c = make_cache(entries=2, budget=1 << 20)
    seqs = [rand_tokens(3) for _ in range(3)]
    for s in seqs[:2]:
        c.insert(s, state_of(s))
    c.lookup(seqs[0] + [1])            # touch the first: the second is now least recent
    c.insert(seqs[2], state_of(seqs[2]))
    assert c.lookup(seqs[1] + [1])[0] == 0 and c.lookup(seqs[0] + [1])[0] == 3
    small = make_cache(entries=8, budget=40)  # 10 floats
    small.insert(rand_tokens(20), state_of(rand_tokens(20)))
    assert len(small) == 0
    for _ in range(4):
        s = rand_tokens(4)
        small.insert(s, state_of(s))
    assert small.nbytes <= 40 and len(small) == 2


def test_disabled_cache_stores_nothing():
    c = make_cache(entries=0)
    c.insert([1, 2], state_of([1, 2]))
    assert c.lookup([1, 2, 3]) == (0, None, None) and len(c) == 0


class HashBackend:
    """Logits that depend on every token consumed, in order (a stand-in whose state is the history)."""
    device = torch.device("cpu")

    def new_state(self):
        return {"t": torch.zeros(0)}

    def _logits(self, s):
        g = torch.Generator().manual_seed(hash(tuple(s["t"].tolist())) % 2**31)
        return torch.randn(300, generator=g)

    def prefill(self, ids, s):
        s["t"] = torch.cat([s["t"], torch.tensor(ids, dtype=torch.float32)])
        return self._logits(s)

    def decode(self, tok, s):
        return self.prefill([tok], s)

    def clone_state(self, s):
        return {"t": s["t"].clone()}

    def state_nbytes(self, s):
        return s["t"].numel() * 4 + 64


from helpers_detok import ByteTok  # noqa: E402,F401


def run(backend, cache, prompt, n=12, **kw):
    req = GenerationRequest(prompt_ids=prompt, max_tokens=n, sampling=SamplingParams(temperature=0.0), **kw)
    events = []
    done = generate(backend, ByteTok(), req, events.append, cache)
    return [t.token for e in events if hasattr(e, "tokens") for t in e.tokens], done


def test_generation_reuses_a_follow_up_prefix_with_identical_output():
    b = HashBackend()
    cache = PrefixCache(4, 1 << 20, b.clone_state, b.state_nbytes)
    turn1 = rand_tokens(10)
    out1, done1 = run(b, cache, turn1)
    assert done1.cached_tokens == 0
    follow = turn1 + out1[:-1] + rand_tokens(5)  # the conversation so far + a new user turn
    warm, done2 = run(b, cache, follow)
    cold, done3 = run(b, None, follow)
    assert done2.cached_tokens == len(turn1) + len(out1) - 1
    assert warm == cold and done3.cached_tokens == 0


def test_a_prompt_sent_again_decodes_from_the_cache_with_identical_output():
    """The same prompt twice (an evaluation harness, a retry): the second runs no prompt token and its tokens are a
    cold run's; a request that does not cache its prompt leaves nothing to reuse."""
    b = HashBackend()
    cache = PrefixCache(4, 1 << 20, b.clone_state, b.state_nbytes)
    prompt = rand_tokens(9)
    cold, done1 = run(b, cache, prompt)
    calls = []
    b.prefill = lambda ids, s, f=b.prefill: calls.append(list(ids)) or f(ids, s)
    warm, done2 = run(b, cache, prompt)
    assert warm == cold and done1.cached_tokens == 0 and done2.cached_tokens == len(prompt)
    assert len(calls) == len(cold) - 1   # the decode steps only (HashBackend.decode is a one-token prefill)
    other = rand_tokens(7)
    run(b, cache, other, cache_prompt=False, cache_output=False)
    assert run(b, cache, other)[1].cached_tokens == 0


def test_turn_boundary_snapshot_serves_a_follow_up_that_diverges_after_it():
    b = HashBackend()
    cache = PrefixCache(4, 1 << 20, b.clone_state, b.state_nbytes)
    turn1 = rand_tokens(10)
    run(b, cache, turn1, snapshot_at=(7,), cache_prompt=False, cache_output=False)
    assert len(cache) == 1
    follow = turn1[:7] + rand_tokens(6)  # same history, the assistant turn rendered differently
    warm, done = run(b, cache, follow)
    assert done.cached_tokens == 7 and warm == run(b, None, follow)[0]


def test_prompt_scoring_runs_the_whole_prompt_in_pieces_past_the_cache(monkeypatch):
    """prompt_logprobs needs every position's logits: a cached prefix is not used, the prompt runs in
    pieces (here of 3 tokens), and each token's log-probability given the ones before it is the
    reference model's, with its top alternatives; max_tokens 0 generates nothing."""
    from lily.config import TINY
    from lily.engine import sequence
    from lily.engine.generation import Started
    from lily.engine.reference_backend import ReferenceBackend
    from lily.synthetic import random_weights

    monkeypatch.setattr(sequence, "PROMPT_SCORING_PIECE", 3)
    weights = random_weights(TINY, seed=random.randrange(1000))
    b = ReferenceBackend(TINY, weights, "cpu")
    cache = PrefixCache(4, 1 << 30, b.clone_state, b.state_nbytes)
    prompt = [random.randrange(TINY.vocab_size) for _ in range(10)]
    run(b, cache, prompt[:6], n=2)  # caches a prefix the scoring request must not start from
    req = GenerationRequest(prompt_ids=prompt, max_tokens=0, prompt_logprobs=3)
    events = []
    done = generate(b, ByteTok(), req, events.append, cache)
    started = next(e for e in events if isinstance(e, Started))
    assert done.cached_tokens == 0 and done.completion_tokens == 0 and done.finish_reason == "length"
    ref = b.model.forward(torch.tensor(prompt), b.new_state(), logits_for="all")
    want = torch.log_softmax(ref.double(), -1)
    assert [s.token for s in started.prompt_logprobs] == prompt[1:]
    for i, s in enumerate(started.prompt_logprobs):
        assert abs(s.logprob - float(want[i, prompt[i + 1]])) < 1e-4, i
        assert torch.allclose(torch.tensor([v for _, v in s.top], dtype=torch.float64), want[i].topk(3).values,
                              atol=1e-4)  # values, not ids: near-ties may order differently
        assert all(abs(v - float(want[i, t])) < 1e-4 for t, v in s.top)


def test_a_long_system_turn_serves_new_conversations_that_share_it(tmp_path):
    """A chat prompt is snapshotted where a leading system turn of SHARED_PREFIX_MIN tokens or more ends (its
    instructions and the tools the template writes there), so a new conversation with the same system turn and
    another first message prefills from there (it prefilled from scratch: only the last full turn was cached);
    its tokens are a cold server's. A short system turn, or a conversation that opens with a user turn, is not."""
    from fastapi.testclient import TestClient

    from helpers_standin import RandomLogitsBackend
    from lily.demo_tokenizer import write_tokenizer_files
    from lily.server.app import ServerSettings, create_app
    from lily.server.generations import SHARED_PREFIX_MIN
    from lily.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(write_tokenizer_files(tmp_path))
    backend = RandomLogitsBackend(tok.vocab_size, random.randrange(1000))

    def client(entries):
        cache = PrefixCache(entries, 1 << 26, backend.clone_state, backend.state_nbytes)
        return TestClient(create_app(backend, tok, ServerSettings(model_name="tiny", max_seq=4096), cache))

    def words(n):
        return " ".join("".join(random.choice("abcdefghij") for _ in range(random.randint(3, 8))) for _ in range(n))

    def ask(c, messages):
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6,
                                                  "temperature": 0, "reasoning_effort": "none"})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def system_turn_tokens(c, messages):
        ids = c.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
        end = ids.index(tok.token_id("<|im_end|>")) + 1
        return end + (ids[end:end + 1] == tok.encode("\n"))

    long_system = {"role": "system", "content": words(random.randint(150, 250))}
    short_system = {"role": "system", "content": words(random.randint(3, 8))}
    with client(16) as warm, client(0) as cold:
        first = [long_system, {"role": "user", "content": words(6)}]
        assert ask(warm, first)[1] == 0
        n = system_turn_tokens(warm, first)
        assert n >= SHARED_PREFIX_MIN
        for _ in range(2):
            other = [long_system, {"role": "user", "content": words(random.randint(2, 9))}]
            text, cached = ask(warm, other)
            assert cached == n and text == ask(cold, other)[0]
        assert system_turn_tokens(warm, [short_system, {"role": "user", "content": "x"}]) < SHARED_PREFIX_MIN
        for opener in (short_system, {"role": "user", "content": words(200)}):
            ask(warm, [opener, {"role": "user", "content": words(5)}])
            again = [opener, {"role": "user", "content": words(5)}]
            text, cached = ask(warm, again)
            assert cached == 0 and text == ask(cold, again)[0]
