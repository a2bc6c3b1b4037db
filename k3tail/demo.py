"""``k3tail demo``: run k3tail's collectives on CPU ranks (default) or in loopback on one GPU,
and print their agreement with the fp64 reference and the wall time.

CPU: ``--world-size`` processes (gloo + Triton interpreter over shared memory) run the
real multi-rank Lamport protocols.  ``--device cuda``: the same W ranks as virtual ranks
in one process on one GPU (loopback).  The interpreter is slow: the default shape is
the K3 one (hidden 7168, latent 3584, top-k 16); ``--small`` uses a small shape.
"""

from __future__ import annotations

import time

import torch

from . import reference as ref
from .testing import moe_triple, randn

K3 = dict(hidden=7168, latent=3584, top_k=16)
SMALL = dict(hidden=512, latent=256, top_k=4)


def add_arguments(parser):
    parser.add_argument("--world-size", "-W", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tokens", "-M", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="token counts to run (default 1 4 16 64)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: one process per rank (interpreter); cuda: loopback on one GPU")
    parser.add_argument("--small", action="store_true", help="small shape (H 512, L 256, top-k 4)")
    parser.add_argument("--seed", type=int, default=0)


def _allreduce_case(op_for_rank, world_run, W, M, width, seed, device):
    xs = [randn((M, width), torch.bfloat16, seed + 31 * r, device=device) for r in range(W)]
    t0 = time.perf_counter()
    ys = world_run(lambda r: op_for_rank(r)(xs[r]))
    if device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    same = all(torch.equal(y.view(torch.int16).cpu(), ys[0].view(torch.int16).cpu()) for y in ys)
    return same, ref.error_stats(ys[0], ref.all_reduce(xs)), dt


def _rank_main(rank, W, shape, tokens, seed):
    """Body of one CPU rank: returns per-M lines (computed identically on every rank)."""
    from .allreduce import OneShotAllReduce

    lines = []
    H = shape["hidden"]
    op = OneShotAllReduce(max_tokens=max(tokens), width=H)
    for M in tokens:
        x = randn((M, H), torch.bfloat16, seed + 1000 * M + 31 * rank)
        t0 = time.perf_counter()
        y = op(x)
        lines.append(("OneShotAllReduce", M, x, y, time.perf_counter() - t0))
    return lines


def main(args) -> int:
    shape = SMALL if args.small else K3
    W = args.world_size
    print(f"k3tail demo: W={W} on {args.device}, shape {shape}, M={args.tokens}")
    t_start = time.perf_counter()
    if args.device == "cpu":
        from .spawn import spawn

        per_rank = spawn(W, _rank_main, shape, args.tokens, args.seed, timeout=1800)
        rows = []
        for i, (name, M, _, y0, _) in enumerate(per_rank[0]):
            xs = [per_rank[r][i][2] for r in range(W)]
            ys = [per_rank[r][i][3] for r in range(W)]
            same = all(torch.equal(y.view(torch.int16), y0.view(torch.int16)) for y in ys)
            st = ref.error_stats(y0, ref.all_reduce(xs))
            wall = max(per_rank[r][i][4] for r in range(W))
            rows.append((name, M, same, st, wall))
    else:
        from .allreduce import OneShotAllReduce
        from .workspace import LoopbackWorld

        world = LoopbackWorld(W)
        H = shape["hidden"]
        ops = world.build(lambda r: OneShotAllReduce(world.group(r), max_tokens=max(args.tokens), width=H))
        rows = []
        for M in args.tokens:
            same, st, dt = _allreduce_case(lambda r: ops[r], world.run, W, M, H, args.seed + M, "cuda")
            rows.append(("OneShotAllReduce", M, same, st, dt))
    print(f"{'op':<24}{'M':>5}  {'ranks agree':<12}{'max ulp':>8}{'<=1ulp':>9}{'bias':>12}{'wall s':>9}")
    ok = True
    for name, M, same, st, wall in rows:
        print(f"{name:<24}{M:>5}  {str(same):<12}{st['max_ulp']:>8.2f}{st['frac_le_1ulp']:>9.4f}"
              f"{st['bias']:>+12.2e}{wall:>9.2f}")
        ok &= same and st["max_ulp"] <= 1.0
    print(f"total wall time {time.perf_counter() - t_start:.1f} s; {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1
