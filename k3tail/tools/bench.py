"""``k3tail bench``: the tier map.  Per-layer time of the K3 tail for every tier possible here,
against M and W, with the selector's choice marked and the baselines measured in the same run.

GPU only.  One GPU: each W runs as W virtual ranks in loopback (``k3tail.LoopbackWorld``):
one CUDA-graph replay (or one eager iteration) launches every virtual rank's kernels, so the
time of a replay is the time until the LAST rank finishes (the max over ranks, by
construction).  Note what loopback means for the numbers: the W ranks share one GPU's SMs and
HBM bandwidth (a loopback W=8 does 8 ranks' work on one GPU), so the times measure protocol
and launch overheads and the relative order of the tiers, not a W-GPU machine's absolute time.
Several GPUs: run under ``torchrun --nproc-per-node W -m k3tail bench``; every process is a
rank, every iteration's time is reduced with MAX over the ranks, rank 0 writes the results.

Timing: graph tiers (TAIL_FUSION, CUTE_FINALIZE) by CUDA-graph replay only (they engage only
in the graph phase); the eager tiers (FUSED_LANE_AR, MULTIMEM_AR, SEPARATE_REDUCE) both by
CUDA-graph replay (what a decode graph runs above the tail capacity) and eagerly (what a
prefill step runs).  A graph holds ``calls`` consecutive tail calls (a few layers, each with
its own up-projection weight, so weights are not L2-resident across calls); the time per
call is replay time / calls; median and p99 over the replays.  Replay counts adapt so every
point takes about ``--budget-s``.

Baselines in the same run: SEPARATE_REDUCE (the unfused reference; every tier's ratio is
against it at the same M and phase) and the cuBLAS projection (``normed @ W_up_shard^T`` per
rank, the GEMM every tier has to do).

Writes ``bench/results/<name>.json`` (device, gpus, loopback, commit, date, torch, triton,
figures) and ``<name>.png`` (the tier map).  The helpers: :mod:`k3tail.tools.bench_rig` (the
ranks, their inputs, :func:`~k3tail.tools.bench_rig.bench_world`), :mod:`k3tail.tools.timing`,
:mod:`k3tail.tools.traffic` (bytes per rank) and :mod:`k3tail.tools.bench_results` (JSON, plots).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

from k3tail.tools import bench_results, bench_rig, traffic
from k3tail.tools.options import (DTYPES, GPU_ONLY_MSG, UsageError, add_loopback_arguments, int_list,
                                  non_negative_float, non_negative_int, positive_float, positive_int)

DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192)
DEFAULT_W = (2, 4, 8)


def make_config(args, max_tokens: int, W: int):
    from k3tail.config import TailConfig

    shard = args.hidden % (8 * W) == 0
    return TailConfig(hidden=args.hidden, latent=args.latent, top_k=args.top_k, dtype=DTYPES[args.dtype],
                      max_tokens=max_tokens, shard_up_proj=shard)


def multiproc_world() -> bool:
    """True under torchrun with several processes (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_multiproc() -> int:
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_world_size()


def add_arguments(parser):
    parser.description = (parser.description or "") + (
        ". GPU only: loopback on one GPU (--world-sizes), or one process per GPU under torchrun "
        "(torchrun --nproc-per-node W -m k3tail bench).")
    add_loopback_arguments(parser, world_sizes=DEFAULT_W)
    parser.add_argument("--m", type=int_list, default=list(DEFAULT_M),
                        help="token counts M, comma-separated (default %(default)s); M above a tier's "
                             "capacity is skipped for that tier")
    parser.add_argument("--tiers", type=lambda s: [t.strip().upper() for t in s.split(",") if t.strip()],
                        default=None, help="only these tiers (comma-separated names; default: all possible)")
    parser.add_argument("--phases", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                        default=["graph", "eager"], help="graph,eager (default both)")
    parser.add_argument("--routed", action="store_true",
                        help="feed materialized routed [M, L] instead of the deferred finalize triple")
    parser.add_argument("--budget-s", type=positive_float, default=0.25,
                        help="seconds of replays per point (default %(default)s)")
    parser.add_argument("--max-calls", type=positive_int, default=8,
                        help="tail calls per captured graph, each with its own weight (default %(default)s)")
    parser.add_argument("--out-dir", default="bench/results", help="where JSON and PNG go (default %(default)s)")
    parser.add_argument("--name", default=None, help="results file stem (default tier_map_<device>)")
    parser.add_argument("--no-plot", action="store_true", help="JSON only")
    parser.add_argument("--no-large-m-baseline", dest="large_m_baseline", action="store_false",
                        help="skip timing the large-M path before the sharded one (large_m='allreduce') "
                             "above the lane capacity")
    parser.add_argument("--lane-max-tokens", type=non_negative_int, default=None,
                        help="lane collective capacity of the K3MoETail built (default: the module's)")
    parser.add_argument("--timeout-s", type=positive_float, default=20.0,
                        help="peer wait timeout (default %(default)s)")
    parser.add_argument("--max-seconds", type=non_negative_float, default=240.0,
                        help="time budget: points not started by then are skipped and listed as such "
                             "(default %(default)s; 0 = none)")


README_BYTES_W, README_BYTES_M = 8, (1024, 8192)


def readme_large_m_bytes(latent: int, hidden: int, dtype) -> dict:
    """``{str(M): k3tail.tools.traffic.table(...)}`` at W=8 for M=1024 and 8192 (allreduce / sharded /
    bf16_lane, process-group formulas): the inputs of the README's large-M bytes table."""
    e = torch.empty((), dtype=dtype).element_size()
    return {str(M): traffic.table(M=M, W=README_BYTES_W, L=latent, H=hidden, e=e) for M in README_BYTES_M}


def main(args) -> int:
    from k3tail.tiers import Tier

    bad = [t for t in (args.tiers or []) if t not in Tier.__members__]
    if bad:
        raise UsageError(f"unknown tier(s) {bad}; known: {list(Tier.__members__)}")
    bad = [p for p in args.phases if p not in ("graph", "eager")]
    if bad:
        raise UsageError(f"unknown phase(s) {bad}; known: graph, eager")
    if not torch.cuda.is_available():
        print(GPU_ONLY_MSG.format(cmd="bench"), file=sys.stderr)
        return 2
    from k3tail.testing import no_multicast

    no_multicast()
    multiproc = multiproc_world()
    world_sizes = [init_multiproc()] if multiproc else list(args.world_sizes)
    rank0 = (not multiproc) or int(os.environ.get("RANK", "0")) == 0
    say = (lambda s: print(s, flush=True)) if rank0 else (lambda s: None)
    ms = sorted(set(args.m))
    t_start = time.perf_counter()
    meta = bench_results.results_meta(loopback=not multiproc)
    say(f"k3tail bench on {meta['device']} ({'torchrun, %d processes' % world_sizes[0] if multiproc else 'loopback'})"
        f": W={world_sizes}, M={ms}, H={args.hidden} L={args.latent} K={args.top_k} {args.dtype}, "
        f"{'routed' if args.routed else 'deferred triple'}")
    deadline = t_start + args.max_seconds if args.max_seconds and args.max_seconds > 0 else None
    worlds = []
    error = None  # a world that raised: the worlds before it are still written, marked incomplete
    for W in world_sizes:
        cfg = make_config(args, max(ms), W)
        t0 = time.perf_counter()
        kw = {"timeout_s": args.timeout_s}
        if args.lane_max_tokens is not None:
            kw["lane_max_tokens"] = args.lane_max_tokens
        try:
            rig = bench_rig.Rig(W, cfg, multiproc=multiproc, module_kwargs=kw)
            say(f"W={W}: built in {time.perf_counter() - t0:.1f} s; caps {rig.caps}; "
                f"tiers {list(bench_rig.tier_ranges(rig.caps, cfg))}")
            old = None
            lane_cap = rig.caps.lane_max_tokens if rig.caps.fused_ar else 0
            if (args.large_m_baseline and rig.caps.fused_ar and any(M > lane_cap for M in ms)
                    and (not args.tiers or "FUSED_LANE_AR" in args.tiers)):
                old = bench_rig.Rig(W, cfg, multiproc=multiproc, prefix="layers.0.baseline",
                           module_kwargs={**kw, "large_m": "allreduce"})
            try:
                wres = bench_rig.bench_world(rig, ms, tiers=args.tiers, phases=args.phases, deferred=not args.routed,
                                   budget_s=args.budget_s, max_calls=max(1, args.max_calls), seed=args.seed,
                                   deadline=deadline, baseline_rig=old, progress=say)
            finally:
                for r in (rig, old):
                    try:
                        if r is not None:
                            r.close()
                    except Exception:  # noqa: BLE001 - a broken CUDA context: keep the first error
                        pass
        except Exception as e:  # noqa: BLE001 - reported, written to the JSON, exit status 1
            error = {"world_size": W, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            logging.getLogger("k3tail").error("k3tail bench: W=%d failed, results of the worlds before it are "
                                              "written and marked incomplete", W, exc_info=True)
            break
        wres["seconds"] = time.perf_counter() - t0
        worlds.append(wres)
        say(f"W={W}: done in {wres['seconds']:.1f} s")
    if not rank0:
        return 1 if error else 0
    name = args.name or f"tier_map_{bench_results.slug(meta['device'])}"
    payload = {
        **meta,
        "what": "per-layer time of the MoE tail (K3MoETail forward, tier forced) against M and W",
        "shape": {"hidden": args.hidden, "latent": args.latent, "top_k": args.top_k, "dtype": args.dtype,
                  "input": "routed" if args.routed else "deferred triple (expert_out, weights, idx)"},
        "timing": {
            "graph": "CUDA-graph replay of `calls` consecutive tail calls (each its own up-projection "
                     "weight); per-call time = replay time / calls; median and p99 over replays",
            "eager": "CUDA events around each eager call on the current stream (includes host launch time)",
            "max_over_ranks": ("loopback: one replay/iteration launches every virtual rank and ends when the "
                               "last rank finishes, so each sample is already the max over ranks; the W ranks "
                               "share one GPU's SMs and bandwidth" if not multiproc else
                               "one process per GPU: each iteration's time is MAX-reduced over the ranks"),
            "budget_s_per_point": args.budget_s,
        },
        "baselines": "SEPARATE_REDUCE is the unfused reference (speedup_vs_separate_reduce per point); "
                     "cublas_projection times every rank's torch.matmul(normed, up_weight_shard.T) alone; "
                     "k3tail_project times every rank's k3tail.project (the tail's batch-invariant GEMM family "
                     "with the fp32 prefix + shared epilogue and one rounding) alone "
                     "(loopback: the W ranks' GEMMs run concurrently "
                     "on the one GPU, as inside the tiers); lane_large_m_allreduce times FUSED_LANE_AR above the "
                     "lane capacity with the large-M path before the sharded one (large_m='allreduce': fp64 lane "
                     "all-reduce on process groups, fp32 one-shot in loopback)",
        "bytes": "bytes_per_rank: what one rank sends per layer in the point's algorithm (k3tail.tools.traffic; "
                 "bytes_formula beside it, W ranks, M tokens, L latent, H hidden, e bytes of the 16-bit dtype); "
                 "large_m_bytes per world: the sharded path, the allreduce path and the seed's bf16 lane "
                 "all-reduce at each M above the lane capacity (process-group formulas); large_m_bytes_w8: the "
                 "same three at W=8, M=1024 and 8192 for this run's shape, whatever W and M were run (the "
                 "README's bytes table)",
        "large_m_bytes_w8": readme_large_m_bytes(args.latent, args.hidden, DTYPES[args.dtype]),
        "worlds": worlds,
        "incomplete": error,
        "figures": [],
        "seconds": time.perf_counter() - t_start,
    }
    if not args.no_plot:
        png = bench_results.tier_map_plot(payload, Path(args.out_dir) / f"{name}.png",
                            title=f"k3tail tier map: {meta['device']}, H={args.hidden} L={args.latent} "
                                  f"K={args.top_k} {args.dtype}{', loopback' if not multiproc else ''}")
        if png:
            payload["figures"].append(png.name)
            say(f"wrote {png}")
    path = bench_results.write_results(name, payload, args.out_dir)
    say(f"wrote {path}")
    print_summary(worlds, say)
    say(f"total {time.perf_counter() - t_start:.1f} s")
    if error:
        say(f"INCOMPLETE: W={error['world_size']} failed ({error['error']}); the worlds before it are in {path}")
        return 1
    return 0


def print_summary(worlds, say) -> None:
    """The median per layer of every point, a table per W and phase, the selector's choice marked."""
    for w in worlds:
        say(f"W={w['world_size']}: median us per layer (selector's choice marked *)")
        tiers = sorted({p["tier"] for p in w["points"]})
        for phase in ("graph", "eager"):
            pts = {(p["tier"], p["M"]): p["median_us"] for p in w["points"] if p["phase"] == phase}
            if not pts:
                continue
            ms = sorted({m for _, m in pts})
            say(f"  {phase:<6}" + "".join(f"{t[:14]:>16}" for t in tiers))
            for m in ms:
                sel = w["selected"][phase].get(str(m))
                cells = []
                for t in tiers:
                    v = pts.get((t, m))
                    cells.append(f"{'' if v is None else f'{v:.1f}' + ('*' if t == sel else ' '):>16}")
                say(f"  M={m:<4}" + "".join(cells))
