"""The one timer of the package's tools and bench scripts: CUDA-graph replay (:func:`time_graph`)
and eager CUDA-event timing (:func:`time_eager`), summarized by :func:`summarize` (median, and p99
by the nearest-rank rule: the ceil(0.99 n)-th smallest sample).

``k3tail bench`` and ``k3tail tune`` size the counts adaptively (a time budget per point); the
scripts in ``bench/`` pass fixed ``calls`` and ``replays``.  Several processes (torchrun): every
host-side count (replays, calls) is rank 0's (:func:`rank_uniform_int`) and every sample is the
MAX over the ranks, so the collectives inside a replay never see ranks replaying different counts.
Callers that must reach fakes (the CPU tests replace ``time_graph`` / ``time_eager`` here) look
the timers up on this module at call time.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


def summarize(samples_us: Sequence[float]) -> Dict[str, Any]:
    """median, p99 (nearest rank), min, mean and count of per-call microseconds."""
    s = sorted(float(x) for x in samples_us)
    if not s:
        return {"median_us": None, "p99_us": None, "min_us": None, "mean_us": None, "n": 0}
    p99 = s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
    return {"median_us": statistics.median(s), "p99_us": p99, "min_us": s[0],
            "mean_us": statistics.fmean(s), "n": len(s)}


def _events(n):
    return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]


def _max_over_ranks(samples: List[float]) -> List[float]:
    """Several processes: element-wise MAX of every rank's per-iteration times (all ranks call)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return samples
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(samples, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.cpu()]


def rank_uniform_int(x: int) -> int:
    """Several processes: rank 0's value of a host-side count (replays, calls): every rank must
    replay the same number of times or the collectives inside the graph deadlock."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(x)
    box = [int(x)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def time_graph(step: Callable[[int], Any], *, max_calls: int = 8, target_replay_us: float = 400.0,
               budget_s: float = 0.3, min_replays: int = 30, max_replays: int = 500,
               warmup: int = 2, calls: Optional[int] = None, replays: Optional[int] = None) -> Dict[str, Any]:
    """CUDA-graph replay timing of ``step(i)`` (one call; ``i`` picks the weight copy).

    Eager warm-up (compiles every kernel variant before capture), then a graph of ``calls``
    consecutive steps (default: about ``target_replay_us`` of work, at most ``max_calls``),
    replayed ``replays`` times (default: until about ``budget_s`` has passed,
    ``min_replays``..``max_replays``).  Returns the :func:`summarize` of per-call times
    (replay time / calls) plus ``calls`` and ``replays``.
    """
    cur = torch.cuda.current_stream()
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    (a, b), = _events(1)
    a.record(cur)
    step(0)
    b.record(cur)
    torch.cuda.synchronize()
    est_call_us = max(a.elapsed_time(b) * 1000.0, 1.0)
    if calls is None:
        calls = max(1, min(max_calls, round(target_replay_us / est_call_us)))
    calls = rank_uniform_int(calls)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            step(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a.record(cur)
    g.replay()
    b.record(cur)
    torch.cuda.synchronize()
    est_replay_s = max(a.elapsed_time(b) / 1000.0, 1e-6)
    if replays is None:
        replays = max(min_replays, min(max_replays, int(budget_s / est_replay_s)))
    replays = rank_uniform_int(replays)
    ev = _events(replays)
    for s, e in ev:
        s.record(cur)
        g.replay()
        e.record(cur)
    torch.cuda.synchronize()
    samples = _max_over_ranks([s.elapsed_time(e) * 1000.0 / calls for s, e in ev])
    del g
    return {**summarize(samples), "calls": calls, "replays": replays}


def time_eager(step: Callable[[int], Any], *, budget_s: float = 0.3, min_iters: int = 20,
               max_iters: int = 300, warmup: int = 3,
               warm_step: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
    """Eager timing of ``step(i)``: CUDA events around each call on the current stream (so a
    host-bound call is measured as host-bound), iterations adapted to ``budget_s``.
    ``warm_step`` (default ``step``) runs the warm-up calls (the ones that may compile)."""
    cur = torch.cuda.current_stream()
    for i in range(warmup):
        (warm_step or step)(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(0)
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    iters = rank_uniform_int(max(min_iters, min(max_iters, int(budget_s / est))))
    ev = _events(iters)
    for i, (s, e) in enumerate(ev):
        s.record(cur)
        step(i)
        e.record(cur)
        if i % 32 == 31:
            torch.cuda.synchronize()  # bound the queue (and the memory of in-flight outputs)
    torch.cuda.synchronize()
    samples = _max_over_ranks([s.elapsed_time(e) * 1000.0 for s, e in ev])
    return {**summarize(samples), "calls": 1, "replays": iters}
