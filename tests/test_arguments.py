"""The non-tensor arguments of ``K3MoETail`` and the standalone ops (tensors: tests/test_bad_inputs.py):
a scalar that is not a finite real number, a bool for a number, a wrong container, is a ValueError
naming the argument at construction, before any rendezvous (so a rank that alone gets one fails its
peers at once and every rank stays in step: tests/test_pairing.py); ``plan_for`` / ``tier_for`` take
``graph_phase=None`` as ``forward`` does; the once-only logs keep no key while their level is off.

World of one, CPU (the interpreter), small shape.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm, LaneAllReduce
from k3tail.ops.tail import LatentTail
from k3tail.tiers import Tier

SHAPE = dict(hidden=64, latent=32, top_k=2)
CFG = k3tail.TailConfig(max_tokens=8, **SHAPE)
NOT_FINITE = (math.nan, math.inf, -math.inf)


def _module(**kw):
    return k3tail.K3MoETail(CFG, prefix=kw.pop("prefix", "args.layers.0"), **kw)


@pytest.mark.parametrize("kw, name", [
    *((dict(timeout_s=v), "timeout_s") for v in (*NOT_FINITE, 0, -1.0, True, "5", None)),
    *((dict(pool_depth=v), "pool_depth") for v in (0, -1, 1.5, "2", True)),
    (dict(tactics=[1]), "tactics"), (dict(tactics="LatentTail"), "tactics"),
    (dict(tactics={"project": 3}), "tactics"), (dict(tactics={"project": {"bogus": 1}}), "bogus"),
    (dict(tactics={"project": {"m16": {"warps": 3}}}), "warps"),
    (dict(tactics_table="table.json"), "tactics_table"),
])
def test_module_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        _module(**kw)
    _module(timeout_s=5, pool_depth=1)  # (an int timeout, the smallest pool: fine)


@pytest.mark.parametrize("arg", ["eps", "routed_scale", "timeout_s"])
def test_op_scalars(arg):
    """The standalone ops refuse a NaN / infinite / bool scalar (a NaN routed_scale made every output NaN)."""
    lane = dict(latent=SHAPE["latent"], hidden=SHAPE["hidden"], max_tokens=4)
    tail = dict(hidden=SHAPE["hidden"], latent=SHAPE["latent"], max_tokens=4, key="args.tail")
    for bad in (*NOT_FINITE, True, "1"):
        if arg == "eps" and bad == -math.inf:
            continue  # (covered by >= 0 as well)
        for make in (lambda **k: FinalizeAllReduceRMSNorm(None, width=SHAPE["latent"], max_tokens=4, **k),
                     lambda **k: LaneAllReduce(None, **lane, **k),
                     lambda **k: LatentTail(None, **tail, **k)):
            with pytest.raises(ValueError, match=arg):
                make(**{arg: bad})
    if arg == "timeout_s":
        for bad in (*NOT_FINITE, 0, True):
            with pytest.raises(ValueError, match="timeout_s"):
                k3tail.OneShotAllReduce(None, max_tokens=4, width=64, timeout_s=bad)


def test_plan_for_graph_phase_none():
    """``graph_phase=None`` in ``plan_for`` / ``tier_for``: whether the stream is capturing now (on the
    CPU never), as in ``forward``; a truthy string is still a ValueError."""
    m = _module(prefix="args.layers.1")
    assert m.tier_for(3, None) == m.tier_for(3, False)
    assert m.plan_for(3, None) == m.plan_for(3, False)
    assert m.tier_for(3, True) == Tier.TAIL_FUSION
    with pytest.raises(ValueError, match="graph_phase"):
        m.tier_for(3, "no")


def test_once_logs_keep_nothing_while_off(caplog):
    """A call's plan is logged once at DEBUG per (layer, shape).  While DEBUG is off nothing is kept for
    it (a key per layer and M grew a set without bound in prefill), so a later module of that layer
    logs it once DEBUG is on."""
    prefix, gamma, up, shared, rt = T.tail_inputs(M=3, W=1, rank=0, form="triple", seed=5, **SHAPE)
    x = dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)
    caplog.set_level(logging.WARNING, logger="k3tail")
    m = _module(prefix="args.layers.log")
    m(**x)
    del m
    caplog.set_level(logging.DEBUG, logger="k3tail")
    m = _module(prefix="args.layers.log")
    m(**x)
    lines = [r.getMessage() for r in caplog.records
             if "args.layers.log" in r.getMessage() and "3 tokens" in r.getMessage()]
    assert len(lines) == 1, lines
    m(**x)
    assert len([r for r in caplog.records if "3 tokens" in r.getMessage()]) == 1
    torch.testing.assert_close(m(**x), m(**x), rtol=0, atol=0)
