"""Bench OneShotAllReduce in loopback on one GPU (W = 2, 4, 8; M = 1..16 at width 7168).

Each replay of a CUDA graph runs all W virtual ranks' kernels; the time per call is the
time until the last rank finishes (the max over ranks).  Baseline in the same run: the
same sum done locally by torch (stack + fp32 sum + round) per rank, which moves the same
bytes without communicating.  Writes JSON + PNG under --out.

    python bench/bench_allreduce.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import k3tail  # noqa: E402
from k3tail.testing import no_multicast, randn  # noqa: E402
from timing import graph_replay_us  # noqa: E402
from plot import results_meta, write_results, line_plot  # noqa: E402


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
        world = k3tail.LoopbackWorld(W)
        ops = world.build(lambda r: k3tail.OneShotAllReduce(world.group(r), max_tokens=max(args.tokens),
                                                            width=args.width))
        for M in args.tokens:
            xs = [randn((M, args.width), torch.bfloat16, 100 * W + r, device=world.device) for r in range(W)]
            ours = graph_replay_us(lambda: world.run(lambda r: ops[r](xs[r])))
            base = graph_replay_us(lambda: world.run(
                lambda r: torch.stack(xs).float().sum(0).to(torch.bfloat16)))
            rows.append({"W": W, "M": M, "width": args.width, "oneshot_us": ours["median_us"],
                         "oneshot_p99_us": ours["p99_us"], "torch_local_sum_us": base["median_us"],
                         "ratio_vs_local_sum": base["median_us"] / ours["median_us"]})
            print(f"W={W} M={M:>3}: OneShotAllReduce {ours['median_us']:7.2f} us (p99 {ours['p99_us']:6.2f})  "
                  f"torch local sum {base['median_us']:7.2f} us  ratio {rows[-1]['ratio_vs_local_sum']:.2f}x",
                  flush=True)
        for op in ops:
            op.check()
    meta = results_meta(loopback=True)
    path = write_results("allreduce_loopback", {**meta, "op": "OneShotAllReduce", "rows": rows}, args.out)
    series = {f"W={W}": [(r["M"], r["oneshot_us"]) for r in rows if r["W"] == W] for W in args.world_sizes}
    series.update({f"torch local sum W={W}": [(r["M"], r["torch_local_sum_us"]) for r in rows if r["W"] == W]
                   for W in args.world_sizes})
    line_plot(series, path.with_suffix(".png"), title=f"OneShotAllReduce loopback, width {args.width} ({meta['device']})",
              xlabel="tokens M", ylabel="us per call (median of graph replays)")
    print("wrote", path)


if __name__ == "__main__":
    main()
