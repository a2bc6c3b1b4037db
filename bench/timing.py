"""Timing helpers shared by the bench scripts: CUDA-graph replay, median and p99."""

from __future__ import annotations

import statistics

import torch


def graph_replay_us(fn, *, reps_in_graph: int = 10, replays: int = 200, warmup: int = 3) -> dict:
    """Capture ``reps_in_graph`` calls of ``fn()`` in one CUDA graph; time ``replays`` replays
    with CUDA events; return per-call microseconds (median, p99, min) over the replays."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps_in_graph):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps_in_graph)
    times.sort()
    return {"median_us": statistics.median(times), "p99_us": times[min(len(times) - 1, int(0.99 * len(times)))],
            "min_us": times[0], "replays": replays, "reps_in_graph": reps_in_graph}
