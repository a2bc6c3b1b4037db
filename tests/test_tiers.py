"""select_tier truth table: every boundary of every capacity, both graph phases."""

import itertools

import numpy
import pytest

from k3tail import TailCaps, Tier, select_tier


def expected(m, gp, c):
    """The issue's order, written independently of the implementation."""
    if gp and m >= 1 and m <= c.cute_max_tokens:
        return Tier.CUTE_FINALIZE
    if gp and m >= 1 and m <= c.tail_fusion_max_tokens:
        return Tier.TAIL_FUSION
    if not c.fused_ar:
        return Tier.SEPARATE_REDUCE
    if c.multimem and c.multimem_min_tokens <= m <= c.multimem_max_tokens:
        return Tier.MULTIMEM_AR
    return Tier.FUSED_LANE_AR


def test_defaults_are_unavailable():
    c = TailCaps()
    got = (c.tail_fusion_max_tokens, c.cute_max_tokens, c.fused_ar, c.lane_max_tokens, c.multimem)
    assert got == (0, 0, False, 0, False)
    assert (c.multimem_min_tokens, c.multimem_max_tokens) == (256, 8192)
    for m in (0, 1, 16, 8192, 10000):
        for gp in (False, True):
            assert select_tier(num_tokens=m, graph_phase=gp, caps=c) is Tier.SEPARATE_REDUCE
    with pytest.raises(Exception):
        c.fused_ar = True  # frozen


def test_tier_enum():
    assert [t.name for t in Tier] == ["TAIL_FUSION", "CUTE_FINALIZE", "MULTIMEM_AR", "FUSED_LANE_AR",
                                      "SEPARATE_REDUCE"]


CAPS = [TailCaps(tail_fusion_max_tokens=t, cute_max_tokens=c, fused_ar=f, lane_max_tokens=64, multimem=mm,
                 multimem_min_tokens=256, multimem_max_tokens=8192)
        for t, c, f, mm in itertools.product((0, 16), (0, 8, 16, 32), (False, True), (False, True))]
MS = sorted({0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 8191, 8192, 8193})


@pytest.mark.parametrize("caps", CAPS, ids=lambda c: f"t{c.tail_fusion_max_tokens}c{c.cute_max_tokens}"
                         f"f{int(c.fused_ar)}m{int(c.multimem)}")
def test_truth_table(caps):
    for m, gp in itertools.product(MS, (False, True)):
        assert select_tier(num_tokens=m, graph_phase=gp, caps=caps) is expected(m, gp, caps), (m, gp, caps)


def test_named_boundaries():
    k3 = TailCaps(tail_fusion_max_tokens=16, fused_ar=True, lane_max_tokens=64)
    assert select_tier(num_tokens=0, graph_phase=True, caps=k3) is Tier.FUSED_LANE_AR   # M=0: no tail
    assert select_tier(num_tokens=1, graph_phase=True, caps=k3) is Tier.TAIL_FUSION
    assert select_tier(num_tokens=16, graph_phase=True, caps=k3) is Tier.TAIL_FUSION
    assert select_tier(num_tokens=17, graph_phase=True, caps=k3) is Tier.FUSED_LANE_AR
    assert select_tier(num_tokens=4, graph_phase=False, caps=k3) is Tier.FUSED_LANE_AR  # eager prefill
    # TAIL_FUSION engages even without the fused all-reduce
    no_ar = TailCaps(tail_fusion_max_tokens=16)
    assert select_tier(num_tokens=16, graph_phase=True, caps=no_ar) is Tier.TAIL_FUSION
    assert select_tier(num_tokens=17, graph_phase=True, caps=no_ar) is Tier.SEPARATE_REDUCE
    # CUTE before TAIL; multimem window inclusive on both ends; multimem needs fused_ar
    full = TailCaps(tail_fusion_max_tokens=16, cute_max_tokens=8, fused_ar=True, lane_max_tokens=64, multimem=True)
    assert select_tier(num_tokens=8, graph_phase=True, caps=full) is Tier.CUTE_FINALIZE
    assert select_tier(num_tokens=9, graph_phase=True, caps=full) is Tier.TAIL_FUSION
    assert select_tier(num_tokens=255, graph_phase=False, caps=full) is Tier.FUSED_LANE_AR
    assert select_tier(num_tokens=256, graph_phase=False, caps=full) is Tier.MULTIMEM_AR
    assert select_tier(num_tokens=8192, graph_phase=True, caps=full) is Tier.MULTIMEM_AR
    assert select_tier(num_tokens=8193, graph_phase=True, caps=full) is Tier.FUSED_LANE_AR
    mm_no_ar = TailCaps(multimem=True)
    assert select_tier(num_tokens=300, graph_phase=False, caps=mm_no_ar) is Tier.SEPARATE_REDUCE


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_tokens"):
        select_tier(num_tokens=-1, graph_phase=False, caps=TailCaps())
    with pytest.raises(ValueError, match="caps"):
        select_tier(num_tokens=1, graph_phase=False, caps={"fused_ar": True})
    with pytest.raises(TypeError):
        select_tier(1, False, TailCaps())  # keyword-only
    caps = TailCaps(fused_ar=True, tail_fusion_max_tokens=16)
    for bad in ("no", "False", 2, None, 1.0):  # a truthy string must not select the graph-phase tier
        with pytest.raises(ValueError, match="graph_phase"):
            select_tier(num_tokens=1, graph_phase=bad, caps=caps)
    for bad in (1.7, "3", True, None):
        with pytest.raises(ValueError, match="num_tokens"):
            select_tier(num_tokens=bad, graph_phase=False, caps=caps)
    assert select_tier(num_tokens=1, graph_phase=1, caps=caps) == select_tier(num_tokens=1, graph_phase=True, caps=caps)
    assert select_tier(num_tokens=numpy.int64(3), graph_phase=True, caps=caps) == Tier.TAIL_FUSION
