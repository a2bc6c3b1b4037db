"""Bench OneShotAllReduce in loopback on one GPU (W = 2, 4, 8; M = 1..16 at width 7168).

Each replay of a CUDA graph runs all W virtual ranks' kernels; the time per call is the
time until the last rank finishes (the max over ranks).  Baseline in the same run: the
same sum done locally by torch (stack + fp32 sum + round) per rank, which moves the same
bytes without communicating.  Writes JSON + PNG under --out.

    python bench/bench_allreduce.py --out bench/results
"""

from __future__ import annotations

import argparse

import torch

import k3tail
from k3tail.testing import no_multicast, randn
from k3tail.tools.bench_results import line_plot, results_meta, write_results
from k3tail.tools.timing import time_graph


def bench_world(W: int, tokens, width: int) -> list:
    """OneShotAllReduce and the local torch sum at every M, W virtual ranks (10 calls per graph,
    200 replays: ``k3tail.tools.timing.time_graph``)."""
    world = k3tail.LoopbackWorld(W)
    ops = world.build(lambda r: k3tail.OneShotAllReduce(world.group(r), max_tokens=max(tokens), width=width))
    rows = []
    for M in tokens:
        xs = [randn((M, width), torch.bfloat16, 100 * W + rk, device=world.device) for rk in range(W)]
        ours = time_graph(lambda i, xs=xs: world.run(lambda r: ops[r](xs[r])), calls=10, replays=200, warmup=3)
        base = time_graph(lambda i, xs=xs: world.run(lambda r: torch.stack(xs).float().sum(0).to(torch.bfloat16)),
                          calls=10, replays=200, warmup=3)
        rows.append({"W": W, "M": M, "width": width, "oneshot_us": ours["median_us"],
                     "oneshot_p99_us": ours["p99_us"], "torch_local_sum_us": base["median_us"],
                     "ratio_vs_local_sum": base["median_us"] / ours["median_us"]})
        print(f"W={W} M={M:>3}: OneShotAllReduce {ours['median_us']:7.2f} us (p99 {ours['p99_us']:6.2f})  "
              f"torch local sum {base['median_us']:7.2f} us  ratio {rows[-1]['ratio_vs_local_sum']:.2f}x",
              flush=True)
    for op in ops:
        op.check()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--width", type=int, default=7168)
    args = ap.parse_args()
    no_multicast()
    rows = []
    for W in args.world_sizes:
        rows += bench_world(W, args.tokens, args.width)
    meta = results_meta(loopback=True)
    path = write_results("allreduce_loopback", {**meta, "op": "OneShotAllReduce", "rows": rows}, args.out)
    series = {f"W={W}": [(r["M"], r["oneshot_us"]) for r in rows if r["W"] == W] for W in args.world_sizes}
    series.update({f"torch local sum W={W}": [(r["M"], r["torch_local_sum_us"]) for r in rows if r["W"] == W]
                   for W in args.world_sizes})
    line_plot(series, path.with_suffix(".png"),
              title=f"OneShotAllReduce loopback, width {args.width} ({meta['device']})",
              xlabel="tokens M", ylabel="us per call (median of graph replays)")
    print("wrote", path)


if __name__ == "__main__":
    main()
