"""lily.kernels.sample: each row's token picked on the device (TRITON_INTERPRET=1 on the CPU, small shapes).

Oracles: the kernels' plain-torch reference (the same race, the kept set by lily.engine.sampling's window
search), numpy's softmax over the kept set computed independently (tests/test_sampling.allowed_set) for the
draws' frequencies, and torch.argmax for greedy rows. Fresh random logits and keys each run; outputs poisoned.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_sampling import allowed_set

from lily.kernels import sample as KS
from lily.kernels.sample import RowSampling, draw_key, sample_rows, sample_rows_reference


def fresh_logits(rows: int, vocab: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(random.randrange(2**31))
    return torch.randn(rows, vocab, generator=g) * scale


def poisoned(rows: int) -> torch.Tensor:
    return torch.full((rows,), -7, dtype=torch.int32)


def random_pick(vocab: int) -> RowSampling:
    return RowSampling(temperature=random.choice([0.0, 0.4, 1.0, 2.5]), top_k=random.choice([0, 0, 3, 50, 1024]),
                       top_p=random.choice([1.0, 1.0, 0.3, 0.9, 0.995]), min_p=random.choice([0.0, 0.0, 0.02, 0.3]),
                       key=random.getrandbits(64))


@pytest.mark.parametrize("vocab,scale", [(37, 3.0), (3000, 2.0), (5000, 0.05)])
def test_kernel_picks_the_references_tokens(vocab, scale):
    """Mixed rows (greedy, unfiltered, top-k, top-p, min-p, all of them; a flat row's nucleus past the window):
    the kernels' tokens are the reference's, token for token."""
    rows = 7
    logits = fresh_logits(rows, vocab, scale)
    picks = [random_pick(vocab) for _ in range(rows)]
    picks[0] = RowSampling(1.0, key=random.getrandbits(64))                        # unfiltered
    picks[1] = RowSampling(1.0, top_p=0.9, min_p=0.001, key=random.getrandbits(64))  # top-p over the vocabulary
    out = sample_rows(logits, picks, use_kernel=True, out=poisoned(rows))
    assert out.tolist() == sample_rows_reference(logits, picks).tolist()


def test_flat_nucleus_past_the_window_is_searched_exactly():
    """Nearly flat logits: top-p keeps thousands of tokens, more than the window holds; the kernels race above
    winners not kept until one is, and land on the reference's token, outside the window at least once."""
    vocab, rows = 6000, 10   # (top-p 0.3-0.6 keeps 1,800-3,600 tokens: the window's 1,024 all kept)
    logits = fresh_logits(rows, vocab, 0.02)
    picks = [RowSampling(1.0, top_p=random.uniform(0.3, 0.6), key=random.getrandbits(64)) for _ in range(rows)]
    got = sample_rows(logits, picks, use_kernel=True, out=poisoned(rows)).tolist()
    assert got == sample_rows_reference(logits, picks).tolist()
    windows = [set(torch.topk(logits[r], KS.WINDOW).indices.tolist()) for r in range(rows)]
    assert any(t not in w for t, w in zip(got, windows))
    for r, (t, pk) in enumerate(zip(got, picks)):
        assert t in allowed_set(logits[r], 1.0, top_p=pk.top_p)


def test_greedy_rows_are_the_argmax_lowest_id_on_ties():
    vocab = 5000
    logits = fresh_logits(3, vocab, 1.0)
    a, b = sorted(random.sample(range(vocab), 2))
    logits[1, a] = logits[1, b] = logits[1].max() + 1.0   # a tie, across slices of the partials
    got = sample_rows(logits, [RowSampling()] * 3, use_kernel=True, out=poisoned(3))
    assert got.tolist() == [int(torch.argmax(logits[0])), a, int(torch.argmax(logits[2]))]


@pytest.mark.parametrize("knobs", [dict(), dict(top_k=4), dict(top_p=0.7), dict(min_p=0.15),
                                   dict(top_k=6, top_p=0.85, min_p=0.05)])
def test_draws_follow_the_kept_distribution(knobs):
    """Many draws of one row (one key each, as a request's successive tokens): only kept tokens, at the
    frequencies of the softmax over the kept set (numpy, float64). The reference draws them all; the kernels
    draw the first hundred keys alike (the same race, so the same distribution)."""
    vocab, draws, temperature = 12, 3000, 0.9
    row = fresh_logits(1, vocab, 1.5)
    seed = random.getrandbits(64)
    picks = [RowSampling(temperature, key=draw_key(seed, n), **knobs) for n in range(draws)]
    got = sample_rows_reference(row.expand(draws, vocab), picks).tolist()
    some = 100
    kernel = sample_rows(row.expand(some, vocab).contiguous(), picks[:some], use_kernel=True, out=poisoned(some))
    assert kernel.tolist() == got[:some]
    kept = sorted(allowed_set(row[0], temperature, **knobs))
    assert set(got) <= set(kept)
    x = row[0].double().numpy()[kept] / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    freq = np.array([got.count(t) for t in kept]) / draws
    # 5 standard deviations of a frequency, at the worst p (0.25): a wrong distribution is off by more
    assert np.abs(freq - p).max() < 5 * np.sqrt(0.25 / draws), (freq, p)


def test_noise_is_uniform_and_keyed():
    """The race's noise: u = exp(-exp(-G)) uniform on (0, 1) over token ids (Kolmogorov-Smirnov), a different
    key gives unrelated noise, the same key the same."""
    ids = torch.arange(200_000)
    key = random.getrandbits(64)
    g = KS.gumbel_reference(ids, key)
    u = torch.exp(-torch.exp(-g.double())).sort().values
    ks = (u - torch.arange(1, u.numel() + 1, dtype=torch.float64) / u.numel()).abs().max()
    assert ks < 1.63 / np.sqrt(u.numel())   # the 1 % critical value
    other = KS.gumbel_reference(ids, key ^ (1 << random.randrange(64)))
    assert abs(float(torch.corrcoef(torch.stack([g, other]))[0, 1])) < 0.02
    assert torch.equal(g, KS.gumbel_reference(ids, key))


def test_draw_keys_differ_by_index_and_seed():
    seed = random.getrandbits(64)
    keys = {draw_key(seed, n) for n in range(1000)} | {draw_key(seed + 1, n) for n in range(1000)}
    assert len(keys) == 2000 and all(0 <= k < 2**64 for k in keys)


def test_top_k_past_the_window_is_refused_by_the_kernels():
    logits = fresh_logits(1, 3000, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        sample_rows(logits, [RowSampling(1.0, top_k=KS.WINDOW + 1)], use_kernel=True)
    assert not KS.handles(KS.WINDOW + 1, 3000) and KS.handles(3000, 3000) and KS.handles(0, 3000)
