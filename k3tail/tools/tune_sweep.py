"""``k3tail tune``'s sweep: a candidate tactic timed at a few M (:func:`evaluate`), and the
coordinate descent over a kernel's tactic space (:func:`sweep_kernel`) within a time
:class:`Budget`.

Split out of :mod:`k3tail.tools.tune` (which re-exports every name here).  Timing goes through
``k3tail.tools.timing.time_graph``, looked up at call time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from k3tail.tools import timing as BT
from k3tail.tools.tune_specs import Spec


class Budget:
    def __init__(self, seconds: Optional[float]):
        self.t0 = time.perf_counter()
        self.end = None if not seconds else self.t0 + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def evaluate(spec: Spec, world, cfg, tactic: dict, ms: Sequence[int], *, tag: str, timeout_s: float,
             budget_s: float, seed: int) -> Dict[str, Any]:
    """Build the op with ``tactic`` on every rank and time it at each M.  Returns
    ``{"score": sum of medians (inf on failure), "us": {M: median}, "resolved": tactic, "error": str|None}``."""
    try:
        ops = spec.build(world, cfg, tactic, tag, timeout_s, max(ms))
    except (ValueError, TypeError) as e:
        return {"score": math.inf, "us": {}, "resolved": dict(tactic), "error": f"rejected: {e}"}
    except Exception as e:  # noqa: BLE001
        return {"score": math.inf, "us": {}, "resolved": dict(tactic), "error": f"{type(e).__name__}: {e}"}
    resolved = spec.resolved(ops)
    us: Dict[int, float] = {}
    try:
        for M in ms:
            step = spec.step_for(world, ops, cfg, M, seed)
            res = BT.time_graph(step, budget_s=budget_s, min_replays=20, max_replays=300)
            us[M] = res["median_us"]
            del step
        for op in ops:
            chk = getattr(op, "check", None)
            if callable(chk):
                chk()
    except Exception as e:  # noqa: BLE001 - a failing candidate is skipped, not fatal
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"score": math.inf, "us": us, "resolved": resolved, "error": f"{type(e).__name__}: {e}"}
    return {"score": sum(us.values()), "us": us, "resolved": resolved, "error": None}


def _fmt_us(us: Dict[int, float]) -> str:
    return " ".join(f"M={m}:{v:.1f}" for m, v in us.items())


def sweep_kernel(spec: Spec, world, cfg, *, full: bool, timeout_s: float, budget_s: float, seed: int,
                 deadline: Budget, say: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    """Coordinate descent over ``spec.space``; returns the best tactic with its timings."""
    W = world.world_size
    ms = spec.ms(full)
    head = f"[tune W={W} {spec.name}]"
    n = [0]

    def run(t):
        n[0] += 1
        return evaluate(spec, world, cfg, t, ms, tag=f"{spec.name}.{W}.{n[0]}", timeout_s=timeout_s,
                        budget_s=budget_s, seed=seed)

    trials: List[Dict[str, Any]] = []  # every measured candidate, in order, for the sweep report

    def note(res, changed=None):
        trials.append({"changed": changed, "tactic": res["resolved"], "us": res["us"],
                       "score": res["score"] if not res["error"] else None, "error": res["error"]})

    base = run({})
    note(base)
    if base["error"]:
        say(f"{head} default tactic failed: {base['error']}; kernel not tuned")
        return None
    say(f"{head} default {base['resolved']}: {_fmt_us(base['us'])} us (sum {base['score']:.1f})")
    best = base
    current = dict(base["resolved"])
    tried = {tuple(sorted(current.items()))}
    skipped = 0
    for key, values in spec.space(full, W, cfg).items():
        for v in values:
            cand = {**current, key: v}
            sig = tuple(sorted(cand.items()))
            if sig in tried:
                continue
            if deadline.left() <= 0:
                skipped += 1
                continue
            tried.add(sig)
            res = run(cand)
            note(res, key)
            mark = ""
            if res["error"]:
                mark = f"skipped ({res['error'][:120]})"
            elif res["score"] < best["score"] * 0.99:  # 1% hysteresis: noise must not flip tactics
                best, mark = res, "new best"
            say(f"{head} {key}={v}: " + (f"{_fmt_us(res['us'])} us (sum {res['score']:.1f}) {mark}"
                                         if not res["error"] else mark))
        current = dict(best["resolved"])
    if skipped:
        say(f"{head} time budget exhausted: {skipped} candidates not measured (use --max-seconds 0 for no limit)")
    gain = base["score"] / best["score"] if best["score"] else 1.0
    say(f"{head} best {best['resolved']}: sum {best['score']:.1f} us ({gain:.2f}x vs default)")
    return {"tactic": best["resolved"], "us": best["score"], "per_m_us": best["us"], "default": base["resolved"],
            "default_us": base["score"], "candidates": n[0], "skipped": skipped, "ms": list(ms), "trials": trials}
