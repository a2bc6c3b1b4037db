"""``k3tail tune``'s crossovers with the sharded large-M path: the threshold logic (pure
functions on synthetic points) and ``tune_crossovers``' two rigs (fakes, CPU, no GPU)."""

import types

import pytest

from k3tail.tiers import TailCaps
from k3tail.tools import bench_rig as BG
from k3tail.tools import tune_crossovers as X

SH = X.LARGE_M_TIER
GRID = [1, 16, 64, 128, 256, 512, 1024]


def pt(tier, M, us, p99=None):
    return {"tier": tier, "M": M, "phase": "graph", "median_us": us, "p99_us": p99 if p99 is not None else us}


def curves(lane=None, sr=None, sh=None, ms=GRID):
    """Points from per-tier cost functions of M (None: that tier has no points)."""
    out = []
    for tier, f in (("FUSED_LANE_AR", lane), ("SEPARATE_REDUCE", sr), (SH, sh)):
        if f is not None:
            out += [pt(tier, m, f(m)) for m in ms if f(m) is not None]
    return out


CAPS = {"tail_fusion_max_tokens": 0, "fused_ar": True, "lane_max_tokens": 1024}
NOLANE = {"tail_fusion_max_tokens": 0, "fused_ar": False, "lane_max_tokens": 0}


def test_suffix_threshold():
    assert X.suffix_threshold({128: False, 256: True, 512: True}, 2048) == 256
    assert X.suffix_threshold({128: True, 256: True}, 2048) == 128  # wins everywhere: the smallest M
    assert X.suffix_threshold({256: True, 1024: False}, 2048) == 2048  # lost at the largest M: never
    assert X.suffix_threshold({}, 2048) == 2048
    assert X.suffix_threshold({64: True, 128: False, 512: True, 1024: True}, 9) == 512  # an early win is noise
    assert X.suffix_threshold({128: False, 512: True, 1024: True}, 9) == 512  # 256 not measured: not extended


def test_large_m_min_tokens_suffix():
    # the sharded path beats SEPARATE_REDUCE from 256 on (an isolated win at 16 does not count)
    sr = lambda m: 10.0 + m  # noqa: E731
    sh = lambda m: 5.0 + m if m == 16 or m >= 256 else 20.0 + m  # noqa: E731
    notes = []
    th = X.crossover_thresholds(curves(sr=sr, sh=sh), NOLANE, grid=GRID, notes=notes)
    assert th == {"large_m_min_tokens": 256} and not notes
    # the sharded path failed at 512 (no point) while SEPARATE_REDUCE ran: a loss there
    pts = [p for p in curves(sr=sr, sh=sh) if not (p["tier"] == SH and p["M"] == 512)]
    assert X.crossover_thresholds(pts, NOLANE, grid=GRID)["large_m_min_tokens"] == 1024
    # ... or hid a timed-out wait (a p99 replay of seconds): a loss too; then it never wins
    pts = [dict(p, p99_us=5e6) if (p["tier"] == SH and p["M"] == 1024) else p for p in curves(sr=sr, sh=sh)]
    notes = []
    assert X.crossover_thresholds(pts, NOLANE, grid=GRID, notes=notes)["large_m_min_tokens"] == 2048
    assert len(notes) == 1 and "large_m_min_tokens=2048" in notes[0] and "never" in notes[0]
    # SEPARATE_REDUCE failed at 512: that M extends nothing, the suffix goes on below it
    pts = [p for p in curves(sr=sr, sh=sh) if not (p["tier"] == "SEPARATE_REDUCE" and p["M"] == 512)]
    assert X.crossover_thresholds(pts, NOLANE, grid=GRID)["large_m_min_tokens"] == 256
    # never wins: a value above the grid asked for (2048 was asked, not measured)
    th = X.crossover_thresholds(curves(sr=sr, sh=lambda m: 2 * sr(m)), NOLANE, grid=GRID + [2048])
    assert th["large_m_min_tokens"] == 4096
    # wins at every M: the smallest measured M
    assert X.crossover_thresholds(curves(sr=sr, sh=lambda m: sr(m) / 2), NOLANE)["large_m_min_tokens"] == 1
    # ties go to the sharded path
    assert X.crossover_thresholds(curves(sr=sr, sh=sr), NOLANE)["large_m_min_tokens"] == 1


def test_large_m_min_tokens_only_with_the_sharded_rig():
    sr = lambda m: 10.0 + m  # noqa: E731
    assert "large_m_min_tokens" not in X.crossover_thresholds(curves(sr=sr), NOLANE)  # no sharded points
    assert "large_m_min_tokens" not in X.crossover_thresholds(curves(sr=sr, sh=sr), NOLANE, sharded=False)
    # the sharded rig ran and failed at every M: it never wins
    notes = []
    assert X.crossover_thresholds(curves(sr=sr), NOLANE, grid=GRID, sharded=True, notes=notes) == {
        "large_m_min_tokens": 2048}
    # ... and the lane has nothing to be held against (no SEPARATE_REDUCE proxy either)
    notes = []
    th = X.crossover_thresholds(curves(lane=sr, sr=sr), CAPS, grid=GRID, sharded=True, notes=notes)
    assert th == {"large_m_min_tokens": 2048} and any("lane_max_tokens not measured" in n for n in notes)
    # no SEPARATE_REDUCE point at all: nothing to hold it against, nothing recorded, said so
    notes = []
    assert X.crossover_thresholds(curves(sh=sr), NOLANE, notes=notes) == {}
    assert any("large_m_min_tokens not measured" in n for n in notes)


def test_lane_max_tokens_against_the_sharded_path(monkeypatch):
    # lane < sharded up to 256, but SEPARATE_REDUCE < lane from 128 on: with fused_ar the
    # selector runs the sharded path above the lane's threshold, never SEPARATE_REDUCE
    lane = lambda m: 10.0 + 2 * m  # noqa: E731
    sr = lambda m: 60.0 + m  # noqa: E731  (beats the lane from M=64 on)
    sh = lambda m: 600.0 + m / 4 if m <= 256 else 1.0  # noqa: E731  (beats both from M=512 on)
    pts = curves(lane=lane, sr=sr, sh=sh)
    assert lane(64) > sr(64) and lane(256) < sh(256) and lane(512) > sh(512)
    th = X.crossover_thresholds(pts, CAPS, grid=GRID)
    assert th["lane_max_tokens"] == 256
    assert th["large_m_min_tokens"] == 512
    # without the sharded rig: held against SEPARATE_REDUCE, as before
    no_sh = [p for p in pts if p["tier"] != SH]
    assert X.crossover_thresholds(no_sh, CAPS) == {"lane_max_tokens": 16}
    # the stricter choice: against the faster of SEPARATE_REDUCE and the sharded path
    monkeypatch.setattr(X, "LANE_ALTERNATIVE", ("SEPARATE_REDUCE", SH))
    assert X.crossover_thresholds(pts, CAPS)["lane_max_tokens"] == 16
    monkeypatch.undo()
    # the lane failed at 64 (no point) while the sharded path ran: a loss there
    pts2 = [p for p in pts if not (p["tier"] == "FUSED_LANE_AR" and p["M"] == 64)]
    assert X.crossover_thresholds(pts2, CAPS)["lane_max_tokens"] == 16
    # the sharded path has no point above 256 (failed, or the grid stopped): those M extend
    # nothing (256, not the capacity 1024), and the lane's own failure at 128 still counts
    pts3 = [p for p in pts if not (p["tier"] == SH and p["M"] > 256)]
    assert X.crossover_thresholds(pts3, CAPS)["lane_max_tokens"] == 256
    pts4 = [p for p in pts3 if not (p["tier"] == "FUSED_LANE_AR" and p["M"] == 128)]
    assert X.crossover_thresholds(pts4, CAPS)["lane_max_tokens"] == 64
    # never above the lane's allocated capacity
    assert X.crossover_thresholds(pts, dict(CAPS, lane_max_tokens=128))["lane_max_tokens"] == 128
    # no lane: no lane threshold, the large-M one still
    assert X.crossover_thresholds(pts, dict(CAPS, fused_ar=False, lane_max_tokens=0)) == {"large_m_min_tokens": 512}


# ------------------------------------------------------------ tune_crossovers with fakes
class _Mod:
    def __init__(self, caps, large_m):
        self.caps = caps
        self.decision = types.SimpleNamespace(alloc=caps)
        self.large_m = large_m


def _fakes(monkeypatch, *, sharded_kind="sharded", sharded_lane=0, sharded_build_error=None, sharded_empty=False):
    built = []

    def rig(W, cfg, *, multiproc, prefix, world, module_kwargs):
        built.append({"prefix": prefix, **module_kwargs})
        if "large_m" in module_kwargs and sharded_build_error:
            raise sharded_build_error
        sharded = "large_m" in module_kwargs
        lane = sharded_lane if sharded else module_kwargs["lane_max_tokens"]
        caps = TailCaps(fused_ar=not sharded, lane_max_tokens=lane)
        return types.SimpleNamespace(mods=[_Mod(caps, sharded_kind if sharded else "sharded")], caps=caps,
                                     sharded=sharded)

    def bench_world(rig, ms, *, tiers, **kw):
        if rig.sharded:
            assert tiers == ["FUSED_LANE_AR"]
            if sharded_empty:
                return {"points": [], "skipped": [{"tier": "FUSED_LANE_AR", "M": m, "why": "lane capacity is 0"}
                                                  for m in ms]}
            return {"points": [pt("FUSED_LANE_AR", m, 50.0 + m / 10) for m in ms]}
        assert tiers is None
        return {"points": [pt("FUSED_LANE_AR", m, 10.0 + m) for m in ms]
                + [pt("SEPARATE_REDUCE", m, 30.0 + m / 2) for m in ms]}

    monkeypatch.setattr(BG, "Rig", rig)
    monkeypatch.setattr(BG, "bench_world", bench_world)
    return built


def _run(ms=(1, 16, 64, 256, 1024)):
    lines = []
    x = X.tune_crossovers(types.SimpleNamespace(world_size=2), dict(hidden=64, latent=32, top_k=4), list(ms),
                           timeout_s=1.0, budget_s=0.01, seed=0, say=lines.append)
    print(*lines, sep="\n")
    return x, lines


def test_tune_crossovers_times_the_sharded_rig(monkeypatch):
    built = _fakes(monkeypatch)
    x, lines = _run()
    assert [b["lane_max_tokens"] for b in built] == [1024, 0]
    assert built[1]["large_m"] == "sharded" and built[1]["prefix"] != built[0]["prefix"]
    assert "large_m" not in built[0]
    # lane 10+M vs sharded 50+M/10: the lane wins up to 44; sharded vs SR 30+M/2 from M=50 on
    assert x["thresholds"] == {"lane_max_tokens": 16, "large_m_min_tokens": 64}
    assert {p["tier"] for p in x["points"]} == {"FUSED_LANE_AR", "SEPARATE_REDUCE", SH}
    assert sum(p["tier"] == SH for p in x["points"]) == 5 and x["sharded_caps"]["lane_max_tokens"] == 0
    assert x["notes"] == [] and any("sharded rig" in s for s in lines)


@pytest.mark.parametrize("how", ["build", "kind", "lane", "empty"])
def test_tune_crossovers_sharded_rig_that_fails_keeps_the_main_thresholds(monkeypatch, how):
    kw = {"build": dict(sharded_build_error=RuntimeError("no symmetric memory")),
          "kind": dict(sharded_kind="allreduce"), "lane": dict(sharded_lane=64),
          "empty": dict(sharded_empty=True)}[how]
    _fakes(monkeypatch, **kw)
    x, lines = _run()
    assert x["thresholds"] == {"lane_max_tokens": 16}
    assert len(x["notes"]) == 1 and "sharded rig failed" in x["notes"][0]
    assert SH not in {p["tier"] for p in x["points"]}
    if how == "empty":  # a rig whose every point was skipped is a failure, not "never wins"
        assert "measured nothing (first skip: lane capacity is 0)" in x["notes"][0]


def test_bench_tier_ranges_with_the_sharded_path():
    from k3tail.config import TailConfig

    cfg = TailConfig(max_tokens=4096)
    # the contract's caps: large_m without the lane (lane_max_tokens=0): FUSED_LANE_AR at every M
    caps = TailCaps(large_m="sharded", large_m_min_tokens=128)
    assert BG.tier_ranges(caps, cfg)["FUSED_LANE_AR"] == (1, 4096)
    assert "FUSED_LANE_AR" not in BG.tier_ranges(TailCaps(), cfg)


def test_tail_fusion_threshold_holds_against_the_sharded_path():
    """Where the sharded rig ran, TAIL_FUSION keeps an M only if it also beats the sharded path there."""
    from k3tail.tools.tune_crossovers import LARGE_M_TIER, crossover_thresholds

    us = {1: (30, 80, 130, 120), 4: (70, 140, 135, 150), 16: (180, 260, 150, 270)}  # TAIL, LANE, SHARDED, SEP
    pts = [{"tier": tier, "M": m, "phase": "graph", "median_us": float(v), "p99_us": float(v)}
           for m, row in us.items()
           for tier, v in zip(("TAIL_FUSION", "FUSED_LANE_AR", LARGE_M_TIER, "SEPARATE_REDUCE"), row, strict=True)]
    caps = {"tail_fusion_max_tokens": 16, "fused_ar": True, "lane_max_tokens": 16}
    th = crossover_thresholds(pts, caps, sharded=True)
    assert th["tail_fusion_max_tokens"] == 4  # beaten by the sharded path at 16
    no_sharded = [p for p in pts if p["tier"] != LARGE_M_TIER]
    assert crossover_thresholds(no_sharded, caps, sharded=False)["tail_fusion_max_tokens"] == 16
