"""``k3tail tune``'s tier crossovers: where the selector's token thresholds should sit.

Two rigs per W (:class:`k3tail.tools.bench_rig.Rig`, timed by its ``bench_world``, both looked up
on :mod:`k3tail.tools.bench_rig` at call time), both timed by graph replay with every tier forced
(``tier=``), on one grid of M:

* the **main rig**: ``K3MoETail(lane_max_tokens=max M)``, every possible tier;
* the **sharded rig**: ``lane_max_tokens=0, large_m="sharded"``, FUSED_LANE_AR only.  With no
  lane allocated, a forced FUSED_LANE_AR runs the sharded large-M path at every M; its points are
  labelled ``LARGE_M_SHARDED``.  A sharded rig that fails to build, comes up with another
  ``large_m`` or a lane, or measures no point at all is reported in ``notes`` and left out (no
  ``large_m_min_tokens``; the lane is then held against SEPARATE_REDUCE).

The thresholds (pure functions of the points, :func:`crossover_thresholds`):

* ``tail_fusion_max_tokens``: largest M up to which TAIL_FUSION beats the tier the selector
  would otherwise take (FUSED_LANE_AR with the lane, else SEPARATE_REDUCE) at every measured M;
* ``lane_max_tokens``: largest M up to which the Lamport lane (the main rig's FUSED_LANE_AR)
  beats what FUSED_LANE_AR runs above the lane's capacity: the sharded path where the sharded
  rig ran (``LANE_ALTERNATIVE``), else SEPARATE_REDUCE, the proxy of the grouped fp32
  all-reduce (in loopback the same two fp32 all-reduces);
* ``large_m_min_tokens`` (sharded rig only): the smallest measured M such that the sharded
  path beats SEPARATE_REDUCE at it and at every larger measured M (a suffix threshold); twice
  the largest grid M when it never does (it lost at the largest M), so the selector never
  takes it.

``max_tokens`` thresholds are applied as ``min(capacity, threshold)``; ``large_m_min_tokens``
as is.  Ties go to the fused / sharded side (``<=``).  A point that failed (no point, or a p99
replay of a second or more: a timed-out wait) loses where its alternative ran; an M where the
alternative has no point extends nothing.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from k3tail import tuning as T
from k3tail.tools import bench_rig

SLOW_REPLAY_US = 1e6  # a point whose p99 replay took >= 1 s hid a timed-out wait: a failure
LARGE_M_TIER = "LARGE_M_SHARDED"  # the sharded rig's FUSED_LANE_AR points
# What the lane is held against when the sharded rig ran.  The selector (fused_ar) runs
# FUSED_LANE_AR at every M and FUSED_LANE_AR runs the sharded path above lane_max_tokens, so
# the sharded path is the lane's real alternative.  ("SEPARATE_REDUCE", LARGE_M_TIER) would
# hold it against the faster of the two instead (stricter: a lane that loses to
# SEPARATE_REDUCE but beats the sharded path would then be cut, and the sharded path run).
LANE_ALTERNATIVE: Tuple[str, ...] = (LARGE_M_TIER,)


def prefix_threshold(wins: Dict[int, bool], capacity: int) -> int:
    """Largest measured M such that the tier won at every measured M' <= M (never above
    ``capacity``); 0 if it lost at the smallest M (or nothing was measured).  An M that was not
    measured (both tiers failed there, or the grid stopped) extends nothing: a tier that won up to
    64 and was not measured above gets 64, not its capacity."""
    last = 0
    for m in sorted(wins):
        if not wins[m]:
            return last
        last = m
    return min(last, capacity)


def suffix_threshold(wins: Dict[int, bool], never: int) -> int:
    """Smallest measured M such that the path won at M and at every larger measured M;
    ``never`` if it lost at the largest measured M (or nothing was measured).  An M that was not
    measured extends nothing: a path that won at 512 and 1024, was not measured at 256 and lost
    at 128 gets 512."""
    first = never
    for m in sorted(wins, reverse=True):
        if not wins[m]:
            break
        first = m
    return first


def _timings(points: List[Dict[str, Any]]) -> Dict[Tuple[str, int], float]:
    """``{(tier, M): median}`` of the graph-phase points that did not fail."""
    return {(p["tier"], p["M"]): p["median_us"] for p in points if p.get("phase", "graph") == "graph"
            and p.get("median_us") and (p.get("p99_us") or 0) < SLOW_REPLAY_US}


def _wins(t, tier: str, alternatives: Sequence[str], ms: Sequence[int]) -> Dict[int, bool]:
    """``{M: tier <= the fastest measured alternative}`` at every M where an alternative has a
    point (the tier's missing point there is a loss)."""
    out = {}
    for m in ms:
        alt = [t[(a, m)] for a in alternatives if (a, m) in t]
        if alt:
            out[m] = (tier, m) in t and t[(tier, m)] <= min(alt)
    return out


def crossover_thresholds(points: List[Dict[str, Any]], caps_alloc: Dict[str, Any], *,
                         grid: Optional[Sequence[int]] = None, sharded: Optional[bool] = None,
                         notes: Optional[List[str]] = None) -> Dict[str, Any]:
    """Thresholds from graph-phase tier timings (``bench_world`` points, the sharded rig's
    relabelled ``LARGE_M_SHARDED``).  ``caps_alloc``: the main rig's allocated caps.  ``grid``:
    the M grid asked for (default: the measured M); its largest M, doubled, is the
    ``large_m_min_tokens`` of a sharded path that never wins.  ``sharded``: the sharded rig ran
    (default: some point is ``LARGE_M_SHARDED``).  ``notes``: a list to append explanations to."""
    t = _timings(points)
    out: Dict[str, Any] = {}
    ms = sorted({m for _, m in t})
    if sharded is None:
        sharded = any(p.get("tier") == LARGE_M_TIER for p in points)
    tf_cap = int(caps_alloc.get("tail_fusion_max_tokens") or 0)
    if tf_cap:
        # TAIL_FUSION must beat what the selector would run in its place: the lane or SEPARATE_REDUCE,
        # and, where the sharded rig ran, the sharded path (FUSED_LANE_AR above the tuned lane capacity)
        alt = ("FUSED_LANE_AR" if caps_alloc.get("fused_ar") else "SEPARATE_REDUCE",) + ((LARGE_M_TIER,) if sharded
                                                                                          else ())
        wins = _wins(t, "TAIL_FUSION", alt, [m for m in ms if m <= tf_cap])
        if wins:
            out["tail_fusion_max_tokens"] = prefix_threshold(wins, tf_cap)
    lane_cap = int(caps_alloc.get("lane_max_tokens") or 0)
    if caps_alloc.get("fused_ar") and lane_cap:
        alts = LANE_ALTERNATIVE if sharded else ("SEPARATE_REDUCE",)
        wins = _wins(t, "FUSED_LANE_AR", alts, [m for m in ms if m <= lane_cap])
        if wins:
            out["lane_max_tokens"] = prefix_threshold(wins, lane_cap)
        elif notes is not None:
            notes.append(f"lane_max_tokens not measured: no {' / '.join(alts)} point to hold the lane against")
    if sharded:
        wins = _wins(t, LARGE_M_TIER, ("SEPARATE_REDUCE",), ms)
        top = max(list(grid or []) + ms, default=0)
        if wins:
            out["large_m_min_tokens"] = suffix_threshold(wins, 2 * top)
            if out["large_m_min_tokens"] > top and notes is not None:
                notes.append(f"large_m_min_tokens={2 * top}: the sharded path did not beat SEPARATE_REDUCE at "
                             f"the largest measured M (grid up to {top}), so the selector never takes it")
        elif notes is not None:
            notes.append("large_m_min_tokens not measured: no SEPARATE_REDUCE point to hold the sharded path against")
    return out


def _release(rig) -> None:
    rig.mods = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tune_crossovers(world, cfg_kwargs: Dict[str, Any], ms: Sequence[int], *, timeout_s: float, budget_s: float,
                    seed: int, say: Callable[[str], None],
                    tactics_table: Optional[T.TacticTable] = None) -> Optional[Dict[str, Any]]:
    """Time every possible tier at each M (graph phase) on the main rig, FUSED_LANE_AR on the
    sharded rig, and derive the selector thresholds.
    ``tactics_table``: the kernels' tactics to time the tiers with (the ones just tuned); its
    crossover entries are ignored, so that earlier thresholds cannot hide a tier."""
    from k3tail.config import TailConfig

    W = world.world_size
    head = f"[tune W={W} crossovers]"
    cfg = TailConfig(**{**cfg_kwargs, "max_tokens": max(ms)})
    kernel_tactics = T.TacticTable(entries={k: v for k, v in (tactics_table.entries if tactics_table else {}).items()
                                            if k.kernel != T.CROSSOVER_KERNEL})
    common = {"tactics_table": kernel_tactics, "timeout_s": timeout_s}
    timing = dict(phases=["graph"], deferred=True, budget_s=budget_s, max_calls=8, seed=seed, baselines=False)
    rig = bench_rig.Rig(W, cfg, multiproc=False, prefix=f"k3tail.tune.crossover.{W}", world=world,
                        module_kwargs={"lane_max_tokens": max(ms), **common})
    caps_alloc = bench_rig.caps_dict(rig.mods[0].decision.alloc)
    say(f"{head} caps {caps_alloc}; timing tiers at M={list(ms)}")
    res = bench_rig.bench_world(rig, ms, tiers=None, progress=lambda s: say(f"{head}{s[1:]}"), **timing)
    _release(rig)
    points = list(res["points"])
    notes: List[str] = []
    sharded, sharded_caps = False, None
    srig = None
    try:
        srig = bench_rig.Rig(W, cfg, multiproc=False, prefix=f"k3tail.tune.crossover.{W}.sharded", world=world,
                             module_kwargs={"lane_max_tokens": 0, "large_m": "sharded", **common})
        sharded_caps = bench_rig.caps_dict(srig.mods[0].decision.alloc)
        kind = srig.mods[0].large_m
        if kind != "sharded" or int(sharded_caps.get("lane_max_tokens") or 0) != 0:
            raise ValueError(f"the sharded rig came up with large_m={kind!r}, lane_max_tokens="
                             f"{sharded_caps.get('lane_max_tokens')} (need 'sharded', 0)")
        say(f"{head} sharded rig (lane_max_tokens=0, large_m='sharded') caps {sharded_caps}; "
            f"timing FUSED_LANE_AR as {LARGE_M_TIER}")
        sres = bench_rig.bench_world(srig, ms, tiers=["FUSED_LANE_AR"],
                                     progress=lambda s: say(f"{head} sharded{s[1:]}"), **timing)
        if not sres["points"]:  # every point skipped (why_not said no) or failed: not "never wins"
            why = (sres.get("skipped") or [{}])[0].get("why", "no point")
            raise RuntimeError(f"it measured nothing (first skip: {why})")
    except Exception as e:  # noqa: BLE001 - the main rig's thresholds still stand
        notes.append(f"sharded rig failed ({type(e).__name__}: {e}); large_m_min_tokens not measured, "
                     f"the lane held against SEPARATE_REDUCE")
        say(f"{head} {notes[-1]}")
    else:
        sharded = True
        points += [{**p, "tier": LARGE_M_TIER} for p in sres["points"]]
    finally:
        if srig is not None:
            _release(srig)
    th = crossover_thresholds(points, caps_alloc, grid=ms, sharded=sharded, notes=notes)
    say(f"{head} thresholds {th}" + "".join(f"\n{head} note: {n}" for n in notes))
    return {"thresholds": th, "points": [{k: p[k] for k in ("tier", "M", "median_us", "p99_us")} for p in points],
            "caps": caps_alloc, "sharded_caps": sharded_caps, "notes": notes}
