"""Benchmark of TAIL_FUSION on one GPU (loopback for the multi-rank parts).

    python bench/bench_tail.py --out bench/results

1. Kernel B alone (``k3tail.ops.tail.shard_gemm``) on the weight shard of W = 8 (896 x 3584)
   and W = 4 (1792 x 3584), M = 1, 4, 16, against ``torch.matmul`` (cuBLAS) on the same
   shard.  Weights rotate over enough copies to exceed L2 (a real decode step streams
   each layer's shard from HBM once).  The default (``batch_invariant`` off: the decode GEMV at
   M <= b_gemv_max_m, the tree above), the tree alone (``batch_invariant=True``) and the best of a
   small sweep of each (tree tactics checked bit-identical to the tree's default; GEMV tactics
   checked against fp32 only: their bits may differ).
2. The whole TAIL_FUSION per layer in loopback W = 8 (8 virtual ranks on one GPU) against
   the composed path in the same loopback: OneShotAllReduce(routed) -> RMSNorm (torch,
   fp32) -> cuBLAS replicated up-projection -> OneShotAllReduce(shared) -> add.  Two
   layers alternate (separate weights, separate pool sets).  Default and ``batch_invariant=True``.
3. Symmetric-memory bytes per rank for 61 MoE layers at W = 8 (formula and measured pool).

CUDA-graph replay, median over replays; JSON + PNG under --out.
"""

# ruff: noqa: B023 - every closure below is captured or timed within the loop iteration that defines it
from __future__ import annotations

import argparse
import json
import os
import sys

from k3tail.testing import no_multicast

no_multicast()  # before any GPU work (DESIGN §8)
import torch  # noqa: E402

import k3tail  # noqa: E402
from k3tail import reference as R  # noqa: E402
from k3tail import testing as T  # noqa: E402
from k3tail.ops.tail import GEMV_MAX_M, LatentTail, shard_gemm  # noqa: E402
from k3tail.tools.bench_results import results_meta  # noqa: E402
from k3tail.tools.timing import time_graph  # noqa: E402

H, LAT, TOPK = 7168, 3584, 16
# kernel B's tile on the GEMM family's reduction tree (gemm.tree_chunks: 8 chunks of K at K3; every tile
# and every b_split gives the same bits: b_split only says how many programs share one N tile's chunks,
# b_k_unroll only unrolls a chunk's loop).  Each result is checked bit-identical to the default tactic's:
# a tactic that is not is reported and left out.
SWEEP = [dict(b_block_n=bn, b_swap_ab=sw, b_tma=tma, b_warps=w, b_stages=st, b_k_unroll=u, b_split=sp)
         for bn, sw, tma, w, st, u, sp in [
             # the tree in one program per N tile (the old grid: 56 programs at W = 8)
             (16, True, False, 4, 16, 1, 1), (16, True, False, 4, 8, 7, 1),
             # the tree's chunks over 2, 4 and 8 programs per N tile
             (16, True, False, 4, 8, 1, 2), (16, True, False, 4, 8, 1, 4), (16, True, False, 4, 8, 1, 8),
             (16, True, False, 4, 4, 1, 8), (16, True, False, 4, 8, 7, 8), (16, True, False, 4, 4, 7, 8),
             (16, True, True, 4, 8, 1, 8), (16, True, True, 4, 4, 7, 8), (32, True, False, 4, 8, 1, 8),
             (16, False, False, 4, 8, 1, 8), (16, True, False, 2, 8, 1, 8), (16, True, False, 8, 8, 1, 8),
             (16, False, False, 2, 8, 1, 8), (32, True, False, 2, 8, 1, 8),
             # W = 4 missed cuBLAS at M = 4 / 16 with the 32-row tile above (issue 29, 4dc7d18: 0.90 / 0.92x):
             # wider tiles (more bytes in flight per program), 1 warp, TMA, fewer stages, half the split
             (64, True, False, 4, 8, 1, 8), (64, True, False, 2, 8, 1, 8), (32, True, False, 1, 8, 1, 8),
             (32, True, True, 2, 8, 1, 8), (32, True, False, 2, 4, 1, 8), (32, True, False, 2, 8, 1, 4)]]
# the decode GEMV (batch_invariant off, M <= b_gemv_max_m): shard rows per program and warps
GEMV_SWEEP = [dict(b_gemv_rows=r, b_gemv_warps=w) for r, w in ((4, 4), (4, 8), (8, 4), (8, 8), (2, 4), (16, 8),
                                                                 (2, 8), (1, 4))]


def median_us(fn, n_inner: int, n_rep: int = 50) -> float:
    """Median microseconds per fn() over CUDA-graph replays of n_inner back-to-back calls."""
    return time_graph(lambda i: fn(), calls=n_inner, replays=n_rep, warmup=3)["median_us"]


def bench_kernel_b(log) -> list:
    rows = []
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    for W, N in ((8, H // 8), (4, H // 4)):
        nbytes = N * LAT * 2
        copies = max(2, -(-3 * l2 // nbytes))
        ws = [T.randn((N, LAT), torch.bfloat16, 10 + i, scale=LAT ** -0.5, device="cuda") for i in range(copies)]
        for M in (1, 4, 16):
            a = T.randn((M, LAT), torch.bfloat16, 1, device="cuda")
            outs = [torch.empty(M, N, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
            ref = (a.float() @ ws[0].float().T)
            it = {"i": 0}

            def cublas():
                i = it["i"] = (it["i"] + 1) % copies
                torch.matmul(a, ws[i].t(), out=outs[i])

            def ours(tac, inv):
                def f():
                    i = it["i"] = (it["i"] + 1) % copies
                    shard_gemm(a, ws[i], out=outs[i], tactics=tac, batch_invariant=inv)
                return f

            t_cublas = median_us(cublas, copies * 4)
            results, inv_results = {}, {}
            gemv = M <= GEMV_MAX_M
            cands = [("default", None, False), ("invariant", None, True)]
            cands += [(f"sweep{j}", t, True) for j, t in enumerate(SWEEP)]
            cands += [(f"gemv{j}", t, False) for j, t in enumerate(GEMV_SWEEP)] if gemv else []
            for name, tac, inv in cands:
                try:
                    for i in range(copies):  # first call per out allocates helpers (outside capture)
                        shard_gemm(a, ws[i], out=outs[i], tactics=tac, batch_invariant=inv)
                    torch.cuda.synchronize()
                    err = float((outs[0].float() - ref).abs().max())
                    if err > 0.05 * float(ref.abs().max()) + 1e-2:
                        log(f"  {name} tactic {tac}: WRONG result (max err {err}); skipped")
                        continue
                    if name == "invariant":
                        bits = outs[0].clone()
                    elif inv and not torch.equal(outs[0].view(torch.int16), bits.view(torch.int16)):
                        diff = int((outs[0].view(torch.int16) != bits.view(torch.int16)).sum())
                        log(f"  {name} tactic {tac}: NOT bit-identical to the tree's default ({diff} outputs "
                            f"differ); left out")
                        continue
                    t_us = median_us(ours(tac, inv), copies * 4)
                    (inv_results if inv else results)[name] = (t_us, tac)
                except Exception as e:  # a tactic that does not compile here
                    log(f"  {name} tactic {tac}: failed ({type(e).__name__}: {e})")
            allr = {**results, **inv_results}
            best = min(allr, key=lambda k: allr[k][0])
            best_inv = min(inv_results, key=lambda k: inv_results[k][0])
            row = dict(W=W, N=N, K=LAT, M=M, cublas_us=t_cublas, gemv=gemv,
                       default_us=results.get("default", (float("nan"),))[0],
                       invariant_us=inv_results.get("invariant", (float("nan"),))[0],
                       best_us=allr[best][0], best_tactic=allr[best][1] or best,
                       best_invariant_us=inv_results[best_inv][0],
                       best_invariant_tactic=inv_results[best_inv][1] or best_inv,
                       weight_mb=nbytes / 1e6, timings={k: v[0] for k, v in allr.items()})
            row["ratio_default"] = t_cublas / row["default_us"]
            row["ratio_best"] = t_cublas / row["best_us"]
            row["gbps_default"] = nbytes / row["default_us"] / 1e3
            row["gbps_best"] = nbytes / row["best_us"] / 1e3
            row["gbps_cublas"] = nbytes / t_cublas / 1e3
            row["ratio_invariant"] = t_cublas / row["invariant_us"]
            log(f"kernel B W={W} shard {N}x{LAT} M={M}: cuBLAS {t_cublas:.2f} us ({row['gbps_cublas']:.0f} GB/s), "
                f"ours default{' (GEMV)' if gemv else ' (tree)'} {row['default_us']:.2f} us "
                f"({row['gbps_default']:.0f} GB/s, x{row['ratio_default']:.2f}), "
                f"batch_invariant {row['invariant_us']:.2f} us (x{row['ratio_invariant']:.2f}, best "
                f"{row['best_invariant_us']:.2f}: {row['best_invariant_tactic']}), "
                f"best {row['best_us']:.2f} us (x{row['ratio_best']:.2f}, {row['best_tactic']})")
            rows.append(row)
    return rows


def kernel_profile(fn, n: int = 20, top: int = 8, graph: bool = False) -> list:
    """Where the device time of ``fn`` goes: ``n`` calls under torch.profiler (``graph``: replays of a
    CUDA graph of one call, as the timing runs it; else eager calls), the kernels by total device time
    (name, calls, mean us).  In loopback the ranks' kernels overlap on one GPU, so a kernel's time
    includes its peers' contention; eagerly, a rank's first kernel also waits for its peers' launches.
    Empty where the profiler records no kernel inside a graph."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    run, per_run = fn, 1
    if graph:  # two calls per graph, as the timing alternates the two layers
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
            fn()
        g.replay()
        torch.cuda.synchronize()
        run, per_run = g.replay, 2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    n *= per_run  # calls profiled
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t and e.count:
            rows.append({"kernel": e.key[:80], "calls_per_call": e.count / n, "mean_us": t / e.count,
                         "total_us_per_call": t / n})
    rows.sort(key=lambda r: -r["total_us_per_call"])
    return rows[:top]


def tail_kwargs(r, deferred, prefix, shared, gamma, wshard, routed, trip) -> dict:
    """Rank ``r``'s arguments of one TAIL_FUSION call: the routed partial, or the deferred finalize triple."""
    kw = dict(prefix_hidden=prefix, shared=shared[r], norm_weight=gamma, up_weight=wshard[r])
    if deferred:
        return dict(kw, expert_out=trip[r][0], expert_weights=trip[r][1], expanded_idx=trip[r][2])
    return dict(kw, routed=routed[r])


def check_outputs(world, tails, wfull, wshard, prefix, shared, gamma, routed, trip) -> dict:
    """The timed tails' outputs, one eager call of each form (routed, deferred triple): every rank's bits
    equal, and rank 0's against the fp64 reference (``testing.check_tail``: 1 ulp + tie slack, or the
    projection's fp32 noise floor).  A timing of a wrong kernel is no timing: the summary says FAILED."""
    W = len(tails)
    ref = dict(prefix_hidden=prefix.cpu(), shared=[x.cpu() for x in shared], norm_weight=gamma.cpu(),
               up_weight=wfull.cpu(), eps=1e-5, noise_floor=True)
    forms = {}
    for form, deferred in (("routed", False), ("deferred", True)):
        ys = world.run(lambda r: tails[r](**tail_kwargs(r, deferred, prefix, shared, gamma, wshard, routed, trip)))
        if deferred:
            parts = [R.rank_partial(expert_out=trip[r][0].cpu(), expert_weights=trip[r][1].cpu(),
                                    expanded_idx=trip[r][2].cpu()) for r in range(W)]
        else:
            parts = [R.rank_partial(routed=routed[r].cpu()) for r in range(W)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ys = [y.cpu() for y in ys]
        ranks_equal = all(torch.equal(ys[0].view(torch.int16), y.view(torch.int16)) for y in ys[1:])
        try:
            st, err = T.check_tail(ys[0], partials=parts, what=form, **ref), None
        except AssertionError as e:
            st, err = {}, str(e)
        forms[form] = dict(ranks_equal=ranks_equal, error=err,
                           **{k: st[k] for k in ("max_ulp", "rel_bias", "frac_within_bound") if k in st})
    if all(v["ranks_equal"] and v["error"] is None for v in forms.values()):
        summary = "ok (ranks bitwise equal; fp64: max " + " / ".join(f"{v['max_ulp']:.2f}" for v in forms.values()) \
            + " ulp)"
    else:
        summary = "CHECK FAILED: " + "; ".join(f"{k}: ranks equal {v['ranks_equal']}, {v['error']}"
                                              for k, v in forms.items())
    return dict(forms, summary=summary)


def loopback_tails(W: int, tactics=None, batch_invariant: bool = False, n_layers: int = 2):
    """The loopback TAIL_FUSION setup that bench_tail times (and probe_tail_a's timeline replays):
    ``(world, groups, tails, wfull, wshard, gamma)``, ``n_layers`` LatentTail layers (``tails[li][r]``)
    called in turn, each with its up-projection (``wfull[li]``, rank r's shard ``wshard[li][r]``)."""
    world = k3tail.LoopbackWorld(W)
    groups = [world.group(r) for r in range(W)]
    S = H // W
    tails = [world.build(lambda r, li=li: LatentTail(groups[r], hidden=H, latent=LAT, top_k=TOPK,
                                                     key=f"model.layers.{li}.mlp", timeout_s=20.0,
                                                     tactics=tactics, batch_invariant=batch_invariant))
             for li in range(n_layers)]
    wfull = [T.randn((H, LAT), torch.bfloat16, 500 + li, scale=LAT ** -0.5, device="cuda") for li in range(n_layers)]
    wshard = [[wfull[li][r * S:(r + 1) * S].contiguous() for r in range(W)] for li in range(n_layers)]
    gamma = (1 + 0.1 * torch.randn(LAT, device="cuda")).to(torch.bfloat16)
    return world, groups, tails, wfull, wshard, gamma


def loopback_inputs(M: int, W: int):
    """``(prefix, shared, routed, trip)`` of M tokens: the prefix, each rank's shared partial, routed
    partial and deferred finalize triple (fixed seeds)."""
    prefix = T.randn((M, H), torch.bfloat16, 1, device="cuda")
    shared = [T.randn((M, H), torch.bfloat16, 10 + r, device="cuda") for r in range(W)]
    routed = [T.randn((M, LAT), torch.bfloat16, 100 + r, device="cuda") for r in range(W)]
    trip = [T.moe_triple(M, TOPK, LAT, torch.bfloat16, 200 + r, device="cuda") for r in range(W)]
    return prefix, shared, routed, trip


def fused_call(world, tails, wshard, gamma, inputs, deferred: bool, st: dict):
    """One TAIL_FUSION call of every rank, on the next layer in turn (``st["l"]``, shared by the forms
    timed together): the routed form, or with ``deferred`` the finalize triple."""
    prefix, shared, routed, trip = inputs

    def f():
        li = st["l"] = (st["l"] + 1) % len(tails)
        world.run(lambda r: tails[li][r](**tail_kwargs(r, deferred, prefix, shared, gamma, wshard[li], routed,
                                                       trip)))
    return f


def bench_tail_loopback(log, W: int = 8, tactics=None, profile_kernels: bool = False,
                        batch_invariant: bool = False) -> list:
    from k3tail.ops.allreduce import OneShotAllReduce

    world, groups, tails, wfull, wshard, gamma = loopback_tails(W, tactics, batch_invariant)
    n_layers = len(tails)
    ar_l = world.build(lambda r: OneShotAllReduce(groups[r], max_tokens=16, width=LAT))
    ar_h = world.build(lambda r: OneShotAllReduce(groups[r], max_tokens=16, width=H))
    rows = []
    for M in (1, 4, 16):
        inputs = loopback_inputs(M, W)
        prefix, shared, routed, trip = inputs
        st = {"l": 0}

        def fused(deferred):
            return fused_call(world, tails, wshard, gamma, inputs, deferred, st)

        def composed_rank(r, li):
            s = ar_l[r](routed[r]).float()
            normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()).to(torch.bfloat16)
            proj = torch.matmul(normed, wfull[li].t())
            sh = ar_h[r](shared[r])
            return prefix + proj + sh

        def composed():
            li = st["l"] = (st["l"] + 1) % n_layers
            world.run(lambda r: composed_rank(r, li))

        t_f = median_us(fused(False), 8)
        t_fd = median_us(fused(True), 8)
        t_c = median_us(composed, 8)
        for tl_ in tails:
            for t in tl_:
                t.check()
        row = dict(W=W, M=M, fused_us=t_f, fused_deferred_us=t_fd, composed_us=t_c, ratio=t_c / t_f,
                   ratio_deferred=t_c / t_fd, tactics=tactics or "default", batch_invariant=batch_invariant)
        row["check"] = check_outputs(world, tails[0], wfull[0], wshard[0], prefix, shared, gamma, routed, trip)
        log(f"loopback W={W} M={M} (tactics {tactics or 'default'}, batch_invariant={batch_invariant}): "
            f"TAIL_FUSION {t_f:.1f} us "
            f"(deferred {t_fd:.1f} us), composed {t_c:.1f} us, x{row['ratio']:.2f}; outputs {row['check']['summary']}")
        if profile_kernels:
            for mode in ("graph", "eager"):
                row[f"kernels_{mode}"] = kernel_profile(fused(False), graph=mode == "graph")
                if not row[f"kernels_{mode}"]:
                    log(f"    {mode}: the profiler recorded no kernel")
                for k in row[f"kernels_{mode}"]:
                    log(f"    {mode} kernel {k['kernel']}: {k['calls_per_call']:.1f} per call, {k['mean_us']:.2f} us "
                        f"each ({k['total_us_per_call']:.1f} us per call, all ranks)")
        rows.append(row)
    return rows


def plot(doc: dict, png: str, log=print) -> None:
    """The figure of one results document (kernel B bars, the loopback tail bars)."""
    figs = doc["figures"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        kb = figs["kernel_b"]
        labels = [f"W={r['W']}\nM={r['M']}" for r in kb]
        x = range(len(kb))
        axes[0].bar([i - 0.3 for i in x], [r["cublas_us"] for r in kb], 0.2, label="cuBLAS")
        axes[0].bar([i - 0.1 for i in x], [r["default_us"] for r in kb], 0.2, label="kernel B (default)")
        axes[0].bar([i + 0.1 for i in x], [r.get("invariant_us", float("nan")) for r in kb], 0.2,
                    label="kernel B (batch_invariant)")
        axes[0].bar([i + 0.3 for i in x], [r["best_us"] for r in kb], 0.2, label="kernel B (best)")
        axes[0].set_xticks(list(x), labels)
        axes[0].set_ylabel("us per call")
        axes[0].set_title("Sharded up-projection (weight shard from HBM)")
        axes[0].legend()
        tl_ = figs.get("tail_loopback") or []
        if tl_:
            x2 = range(len(tl_))
            axes[1].bar([i - 0.2 for i in x2], [r["composed_us"] for r in tl_], 0.4, label="composed")
            axes[1].bar([i + 0.2 for i in x2], [r["fused_us"] for r in tl_], 0.4, label="TAIL_FUSION")
            tuned = [("" if r.get("tactics", "default") == "default" else "\n(tuned B)")
                     + ("\n(invariant)" if r.get("batch_invariant") else "") for r in tl_]
            axes[1].set_xticks(list(x2), [f"M={r['M']}{t}" for r, t in zip(tl_, tuned)])
            axes[1].set_ylabel("us per layer (8 virtual ranks, one GPU)")
            axes[1].set_title("MoE tail, loopback W=8")
            axes[1].legend()
        fig.suptitle(f"{doc['device']}  torch {doc['torch']}  triton {doc['triton']}")
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        log(f"wrote {png}")
    except Exception as e:
        log(f"plot skipped: {type(e).__name__}: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--skip-loopback", action="store_true")
    ap.add_argument("--skip-kernel-b", action="store_true", help="only the loopback tail (part 2)")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG of an earlier results file beside it")
    ap.add_argument("--name", default="bench_tail", help="basename of the JSON and PNG written under --out")
    ap.add_argument("--loopback-tactics", nargs="*", default=[],
                    help="LatentTail tactic dicts (JSON) to measure in the loopback part beside the default")
    ap.add_argument("--profile", action="store_true",
                    help="also the device time per kernel of the loopback TAIL_FUSION (torch.profiler: graph "
                         "replays, then eager calls)")
    ap.add_argument("--baseline", default=None,
                    help="an earlier bench_tail JSON: print this run's loopback TAIL_FUSION times against its own")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return
    if not torch.cuda.is_available():
        sys.exit("bench_tail needs a CUDA GPU")
    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    figs = {"kernel_b": [] if args.skip_kernel_b else bench_kernel_b(log)}
    if not args.skip_loopback:
        try:
            figs["tail_loopback"] = bench_tail_loopback(log, profile_kernels=args.profile)
            figs["tail_loopback"] += bench_tail_loopback(log, profile_kernels=args.profile, batch_invariant=True)
            for t in args.loopback_tactics:
                figs["tail_loopback"] += bench_tail_loopback(log, tactics=json.loads(t))
        except Exception as e:  # report, keep the kernel-B figures
            log(f"loopback bench failed: {type(e).__name__}: {e}")
    if args.baseline and figs.get("tail_loopback"):
        with open(args.baseline) as f:
            base = json.load(f)
        old = {(r["W"], r["M"]): r for r in base["figures"].get("tail_loopback", []) if "tactics" not in r}
        for r in figs["tail_loopback"]:
            if r["tactics"] != "default":
                continue
            b = old.get((r["W"], r["M"]))
            if b:
                pct = 100 * (r["fused_us"] / b["fused_us"] - 1)
                log(f"vs {args.baseline} (commit {base.get('commit')}): loopback W={r['W']} M={r['M']} "
                    f"({r['tactics']}) TAIL_FUSION "
                    f"{r['fused_us']:.1f} us vs {b['fused_us']:.1f} us ({pct:+.1f}%)")
    nb = LatentTail.workspace_bytes(hidden=H, latent=LAT, world_size=8, max_tokens=16, pool_depth=2,
                                    num_layers=61)
    figs["symm_bytes_per_rank_61_layers_w8"] = nb
    log(f"symmetric memory per rank, 61 layers, W=8, pool depth 2: {nb / 2**20:.2f} MiB (target <= 32 MB)")
    doc = {**results_meta(loopback=True),
           "pdl": os.environ.get("K3TAIL_DISABLE_PDL", "0") in ("", "0"), "figures": figs, "log": lines}
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    log(f"wrote {path}")
    plot(doc, os.path.join(args.out, f"{args.name}.png"), log)


if __name__ == "__main__":
    main()
