"""Stress one tier of K3MoETail in loopback with CUDA-graph replays and report the first wait that
times out: which rank, which op's workspace, and that workspace's control words.

A diagnostic, not a benchmark: every replay is followed by a sync and a look at every poison
flag.  Written after ``k3tail tune`` saw one 10 s replay (two 5 s timeouts) of FUSED_LANE_AR at
W = 8, M = 64 in loopback on the H200.

    python bench/stress_loopback.py --world-size 8 --m 64 --tier FUSED_LANE_AR --replays 300

Seen on the H200 (b0e88a7): W=8 FUSED_LANE_AR timed out in the module's loopback gather at
M=64 and M=63; W=4 SEPARATE_REDUCE at M=64 too (eager as well).  Cause: with ``SMs // W``
spinning programs per virtual rank every SM held a spinner, so another rank's cuBLAS projection
(M > 16), whose blocks need a whole SM, could not be placed and the gather waiting for that
rank timed out.  ``k3tail.runtime.launch.grid_cap`` now lets all spinners together take half the SMs
(``K3TAIL_LOOPBACK_SPIN_SHARE``); at bea3323 ``K3TAIL_LOOPBACK_SPIN_SHARE=1.0`` still fails the
W=4 case and the default runs W=4/8 at M=63/64 (100 replays), W=2 M=4096 and W=8 M=256 clean.
``bench/loopback_diag.sh`` runs such cases one process each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from k3tail.testing import no_multicast

no_multicast()  # before any GPU work (DESIGN §8)
import torch  # noqa: E402

import k3tail  # noqa: E402
from k3tail import tuning  # noqa: E402
from k3tail.runtime.workspace import Workspace  # noqa: E402
from k3tail.tiers import Tier  # noqa: E402
from k3tail.tools.bench_rig import rank_inputs, rank_weights  # noqa: E402


def workspaces(mod):
    """``(path, Workspace)`` of every op a K3MoETail owns: the workspaces found under its
    ``context`` (the tier ops, the collectives and the ops inside them), a few attributes deep."""
    out, seen = [], set()

    def visit(obj, path, depth):
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, Workspace):
            out.append((path, obj))
            return
        items = obj.items() if isinstance(obj, dict) else vars(obj).items() if hasattr(obj, "__dict__") else ()
        for k, v in items:
            if v is not None and not isinstance(v, (torch.Tensor, int, float, str, bool)):
                visit(v, f"{path}.{k}", depth + 1)

    visit(mod.context, "context", 0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tier", default="FUSED_LANE_AR")
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--calls-per-graph", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--eager", action="store_true", help="no CUDA graph: eager steps, a sync after each")
    ap.add_argument("--check-inputs", action="store_true",
                    help="after every replay compare each rank's inputs with a copy taken before (finds stray writes)")
    args = ap.parse_args()
    print("env:", {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "K3TAIL_DISABLE_PDL")}, flush=True)
    if not torch.cuda.is_available():
        sys.exit("stress_loopback: needs a CUDA GPU")
    W, M = args.world_size, args.m
    cfg = k3tail.TailConfig(max_tokens=args.max_tokens)
    world = k3tail.LoopbackWorld(W)
    mods = world.build(lambda r: k3tail.K3MoETail(cfg, world.group(r), prefix="stress", timeout_s=args.timeout_s,
                                                  lane_max_tokens=args.max_tokens,
                                                  tactics_table=tuning.TacticTable()))
    tier = Tier[args.tier]
    dev = world.device
    ins = [rank_inputs(M=M, hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, dtype=cfg.dtype, device=dev,
                       seed=r, deferred=True) for r in range(W)]
    wts = [rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=cfg.hidden // W, copies=1, dtype=cfg.dtype,
                        device=dev, seed=100 + r) for r in range(W)]

    def step():
        return world.run(lambda r: mods[r](**ins[r], norm_weight=wts[r][0], up_weight=wts[r][1][0], tier=tier,
                                           graph_phase=True))

    copies = [{k: v.clone() for k, v in d.items()} for d in ins]

    def inputs_intact(what):
        for r in range(W):
            for k, v in ins[r].items():
                if not torch.equal(v, copies[r][k]):
                    print(f"{what}: rank {r}'s input {k} was overwritten", flush=True)
                    return False
        return True

    def failed(what):
        """After a synced step: report poisoned workspaces (and overwritten inputs); True if any."""
        bad = [(r, n, ws.ctrl[:4].tolist()) for r in range(W) for n, ws in workspaces(mods[r]) if ws.poisoned()]
        if bad or (args.check_inputs and not inputs_intact(what)):
            print(f"{what}: poisoned workspaces (rank, op, ctrl[:4]) = {bad}", flush=True)
            return True
        return False

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    if args.eager:
        t0 = time.time()
        for i in range(args.replays):
            step()
            torch.cuda.synchronize()
            if failed(f"eager step {i}"):
                return 1
        print(f"{args.replays} eager steps clean in {time.time() - t0:.1f} s", flush=True)
        return 0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(args.calls_per_graph):
            step()
    print(f"W={W} M={M} {tier.name}: graph of {args.calls_per_graph} calls; ops per rank: "
          f"{[n for n, _ in workspaces(mods[0])]}", flush=True)
    t0 = time.time()
    slow = []
    for i in range(args.replays):
        a = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        dt = time.perf_counter() - a
        if dt > 0.5:
            slow.append((i, dt))
        if failed(f"replay {i} ({dt:.2f} s)"):
            break
    else:
        print(f"{args.replays} replays clean in {time.time() - t0:.1f} s; slow replays {slow}", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
