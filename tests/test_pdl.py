"""lily.kernels.pdl's choice of programmatic launches: LILY_PDL's spellings, and nothing programmatic where it
cannot be (the interpreter: every kernel's GDC off, no launch option)."""

import pytest
import torch

from lily.kernels import pdl


def test_the_spellings_of_lily_pdl():
    assert pdl.parse("1") == pdl.parse("all") == frozenset(pdl.FAMILIES)
    assert pdl.parse("0") == pdl.parse("") == pdl.parse("none") == frozenset()
    assert pdl.parse("moe") == frozenset({"gate_up"})          # the old name of the old default
    assert pdl.parse("gemv,gdn") == frozenset({"attn_in", "attn_out", "gdn_in", "gdn_out", "router", "lm_head", "gdn"})
    assert pdl.parse(pdl.DEFAULT) <= frozenset(pdl.FAMILIES)
    assert pdl.parse(" gate_up, down ,gdn") == frozenset({"gate_up", "down", "gdn"})
    assert pdl.describe(pdl.parse("down,gate_up")) == "gate_up,down"   # in FAMILIES' order
    assert pdl.describe(frozenset()) == "0"
    assert pdl.parse("rows") == frozenset(pdl.BATCHED) and "rows_gdn" in pdl.BATCHED   # the batched step's
    assert pdl.parse("rows,gdn") == frozenset(pdl.BATCHED) | {"gdn"}
    with pytest.raises(ValueError, match="unknown kernel families.*'mlp'"):
        pdl.parse("gate_up,mlp")


def test_set_mode_switches_and_returns_the_previous_families():
    old = pdl.set_mode("gdn_in,attn")
    try:
        assert pdl.MODE == frozenset({"gdn_in", "attn"})
        assert pdl.set_mode("0") == frozenset({"gdn_in", "attn"})
    finally:
        pdl.set_mode(pdl.describe(old))
    assert pdl.MODE == old


def test_nothing_is_programmatic_on_the_interpreter():
    old = pdl.set_mode("all")
    try:
        t = torch.empty(1)
        assert not pdl.gdc(t)
        assert not any(pdl.active(t, f) for f in pdl.FAMILIES)
        assert pdl.launch_opts(t, "gdn_in") == {}
        assert pdl.kernel_args(t, "rows_gdn") == {} and pdl.kernel_args(t, None) == {}
    finally:
        pdl.set_mode(pdl.describe(old))


def test_kernel_args_of_a_family_on_a_capable_device(monkeypatch):
    """Where launches can be programmatic: a family in LILY_PDL waits and launches so, one outside it waits (its
    kernel still triggers the next) and launches plainly, a launch of no family compiles no wait at all."""
    monkeypatch.setattr(pdl, "_capable", lambda t: True)
    old = pdl.set_mode("rows_gdn,gate_up")
    try:
        t = torch.empty(1)
        assert pdl.kernel_args(t, "rows_gdn") == {"GDC": True, "launch_pdl": True}
        assert pdl.kernel_args(t, "rows_attn") == {"GDC": True}
        assert pdl.kernel_args(t, None) == {}
        pdl.set_mode("0")
        assert pdl.kernel_args(t, "rows_gdn") == {}
    finally:
        pdl.set_mode(pdl.describe(old))
