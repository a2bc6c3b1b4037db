"""Bench the large-M (prefill) tail against issue 14's targets, every ratio from one run (H200).

(a) finalize, W = 1, K3 shape (L 3584, top-k 16), M = 1024 and 8192: the Triton finalize
    (``k3tail.ops.prefill.finalize_to_shards``, one shard) vs ``torch.compile`` of the plain
    ``(expert_out[idx].float() * w).sum(1)`` and vs the torch finalize it replaces
    (``numerics.routed_partial``); the read-bandwidth floor counts the bf16 expert rows read and
    the fp32 rows written at 4 TB/s.  Targets at M = 8192: >= 60% of the floor, >= 3x torch.compile.
(b) ``K3MoETail`` at W = 1 (no communication), M = 1, 1024 and 8192: fed the deferred triple vs
    materialized ``routed`` vs ``torch.compile`` of the plain composite tail (finalize, RMSNorm,
    GEMM, adds), eager (CUDA events around each call) and in graph replay.  Targets: deferred <= 1.2x
    materialized at M = 8192; eager >= 1.3x the compiled composite at M = 1024, >= 1.5x at 8192.
(c) host time of one eager call at W = 1 (every M of (b)): the CPU wall time of 20 calls enqueued
    behind a busy GPU, / 20 (issue 19's method), the Triton launches' share of it, and the number of
    GPU kernels one call launches (torch profiler).  Target <= 100 us.
(d) loopback W = 8, M = 1024..8192: FUSED_LANE_AR with the sharded large-M path vs the path
    before it (``large_m="allreduce"``), graph replay.  Target >= 3x.  Loopback: the W virtual
    ranks share one GPU; the bytes per rank (``k3tail.tools.traffic``) are what a several-GPU machine
    would move.

Timing: CUDA-graph replay, median over replays (``k3tail.tools.bench.time_graph``).  Writes
``<out>/prefill.json`` and ``<out>/prefill.png``.

    python bench/bench_prefill.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from k3tail.testing import no_multicast  # noqa: E402

no_multicast()
from k3tail.tools import bench_results as BR  # noqa: E402
from k3tail.tools import bench_rig as BG  # noqa: E402
from k3tail.tools import timing as BT  # noqa: E402
from k3tail import numerics  # noqa: E402
from k3tail.tools import traffic  # noqa: E402

K3 = dict(hidden=7168, latent=3584, top_k=16)
BW = 4.0e12  # bytes/s, the H200's HBM3e read bandwidth (nominal 4.8; 4 is what the floor assumes)


def plain_finalize(eo, w, idx):
    return (eo[idx.long()].float() * w.float()[..., None]).sum(1)


def plain_tail(prefix, shared, gamma, up, eo, w, idx, eps=1e-5):
    x = plain_finalize(eo, w, idx)
    n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(prefix.dtype)
    return (prefix.float() + (n @ up.t()).float() + shared.float()).to(prefix.dtype)


def ratio(a, b):
    return (a / b) if a and b else None


def verdict(ok, text):
    return f"{'met' if ok else 'MISSED'}: {text}"


def part_a(ms, budget, say):
    from k3tail.ops.prefill import finalize_to_shards

    out = {}
    comp = torch.compile(plain_finalize)
    for M in ms:
        ins = BG.rank_inputs(M=M, device="cuda", seed=M, deferred=True, dtype=torch.bfloat16, **K3)
        eo, w, idx = ins["expert_out"], ins["expert_weights"], ins["expanded_idx"]
        L, K = K3["latent"], K3["top_k"]
        floor_us = (M * K * L * 2 + M * L * 4) / BW * 1e6
        dst = torch.empty(M * L, dtype=torch.float32, device="cuda")
        tri = BT.time_graph(lambda i: finalize_to_shards(expert_out=eo, expert_weights=w, expanded_idx=idx,
                                                        bounds=[0, L], out=dst), budget_s=budget)
        same = torch.equal(dst.view(M, L), numerics.routed_partial(expert_out=eo, expert_weights=w, expanded_idx=idx))
        cmp_ = BT.time_graph(lambda i: comp(eo, w, idx), budget_s=budget)
        old = BT.time_graph(lambda i: numerics.routed_partial(expert_out=eo, expert_weights=w, expanded_idx=idx),
                           budget_s=budget, max_calls=2)
        r = {"floor_us": floor_us, "triton": tri, "torch_compile_plain": cmp_, "torch_routed_partial": old,
             "bits_equal_routed_partial": bool(same),
             "fraction_of_floor": floor_us / tri["median_us"],
             "speedup_vs_compile": ratio(cmp_["median_us"], tri["median_us"]),
             "speedup_vs_routed_partial": ratio(old["median_us"], tri["median_us"])}
        out[str(M)] = r
        say(f"(a) M={M}: triton {tri['median_us']:.1f} us ({100 * r['fraction_of_floor']:.0f}% of the "
            f"{floor_us:.1f} us floor), torch.compile {cmp_['median_us']:.1f} us ({r['speedup_vs_compile']:.2f}x), "
            f"routed_partial {old['median_us']:.1f} us ({r['speedup_vs_routed_partial']:.1f}x); bits equal: {same}")
        del ins
    return out


def host_time_us(call, n: int = 20) -> float:
    """Host time of one call: the CPU wall time of ``n`` calls enqueued behind a busy GPU, divided by
    ``n`` (the GPU never waits for the host here, so what is measured is the host's own cost)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU work ahead of the calls: they only enqueue
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def part_b_c(ms, budget, say, chain_above=None):
    """(b) K3MoETail W = 1 vs the compiled composite, eager (CUDA events around each call: a host-bound
    call is measured as host-bound) and in graph replay; (c) host time and launches of one eager call.
    ``chain_above``: also time (eager and graph, deferred inputs) a second module built with
    ``projection.FAST_CHAIN_ABOVE = chain_above`` (the fast mode's single K chain above that M: the
    staged arithmetic of issue 29, ``triton_kernels/gemm.py`` "The chain"), beside the default one."""
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail
    from k3tail.ops import projection
    from k3tail.runtime import launch as KL

    out = {}
    mod = K3MoETail(TailConfig(max_tokens=max(ms), **K3), prefix="bench.prefill.w1")
    mod_chain = None
    if chain_above is not None:
        saved = projection.FAST_CHAIN_ABOVE
        projection.FAST_CHAIN_ABOVE = chain_above
        try:
            mod_chain = K3MoETail(TailConfig(max_tokens=max(ms), **K3), prefix="bench.prefill.w1.chain")
        finally:
            projection.FAST_CHAIN_ABOVE = saved
        assert mod_chain.negotiated["chain_above"] == chain_above, mod_chain.negotiated["chain_above"]
    comp = torch.compile(plain_tail)
    gamma, ups = BG.rank_weights(hidden=K3["hidden"], latent=K3["latent"], up_rows=K3["hidden"], copies=1,
                                dtype=torch.bfloat16, device="cuda", seed=1)
    up = ups[0]
    for M in ms:
        tri = BG.rank_inputs(M=M, device="cuda", seed=M, deferred=True, dtype=torch.bfloat16, **K3)
        mat = {**{k: tri[k] for k in ("prefix_hidden", "shared")},
               "routed": numerics.routed_partial(expert_out=tri["expert_out"], expert_weights=tri["expert_weights"],
                                                 expanded_idx=tri["expanded_idx"]).to(torch.bfloat16)}

        def call(ins):
            return mod(**ins, norm_weight=gamma, up_weight=up, graph_phase=False)

        def composite():
            return comp(tri["prefix_hidden"], tri["shared"], gamma, up, tri["expert_out"], tri["expert_weights"],
                        tri["expanded_idx"])

        ours, theirs = call(tri), composite()
        err = (ours.double() - theirs.double()).abs().max().item()  # same function, bf16 outputs apart
        d_e = BT.time_eager(lambda i: call(tri), budget_s=budget)
        c_e = BT.time_eager(lambda i: composite(), budget_s=budget)
        d = BT.time_graph(lambda i: call(tri), budget_s=budget)
        m = BT.time_graph(lambda i: call(mat), budget_s=budget)
        c = BT.time_graph(lambda i: composite(), budget_s=budget)
        plan = mod.plan_for(M, False)
        r = {"tier": plan.tier.name, "path": plan.path, "eager_deferred": d_e, "eager_compiled_composite": c_e,
             "eager_speedup_vs_compiled": ratio(c_e["median_us"], d_e["median_us"]),
             "deferred": d, "materialized": m, "compiled_composite": c,
             "deferred_over_materialized": ratio(d["median_us"], m["median_us"]),
             "speedup_vs_compiled": ratio(c["median_us"], d["median_us"]), "max_abs_diff_vs_composite": err}
        if mod_chain is not None:
            def call_chain(ins):
                return mod_chain(**ins, norm_weight=gamma, up_weight=up, graph_phase=False)

            y = call_chain(tri)
            ch_e = BT.time_eager(lambda i: call_chain(tri), budget_s=budget)
            ch_g = BT.time_graph(lambda i: call_chain(tri), budget_s=budget)
            r["chain"] = {"chain_above": chain_above, "chain": M > chain_above, "eager": ch_e, "graph": ch_g,
                          "eager_speedup_vs_compiled": ratio(c_e["median_us"], ch_e["median_us"]),
                          "speedup_vs_compiled": ratio(c["median_us"], ch_g["median_us"]),
                          "max_abs_diff_vs_composite": (y.double() - theirs.double()).abs().max().item(),
                          "max_abs_diff_vs_tree": (y.double() - ours.double()).abs().max().item()}
            say(f"(b) M={M} chain above {chain_above} ({'chain' if M > chain_above else 'tree'}): eager "
                f"{ch_e['median_us']:.1f} us ({r['chain']['eager_speedup_vs_compiled']:.2f}x the compiled "
                f"composite), graph {ch_g['median_us']:.1f} us ({r['chain']['speedup_vs_compiled']:.2f}x); "
                f"max |chain - tree| {r['chain']['max_abs_diff_vs_tree']:.3g}")
        say(f"(b) M={M} ({r['tier']}, path {r['path']}): eager {d_e['median_us']:.1f} us vs compiled composite "
            f"{c_e['median_us']:.1f} us ({r['eager_speedup_vs_compiled']:.2f}x); "
            f"graph: deferred {d['median_us']:.1f} us, "
            f"materialized {m['median_us']:.1f} us ({r['deferred_over_materialized']:.2f}x), compiled composite "
            f"{c['median_us']:.1f} us ({r['speedup_vs_compiled']:.2f}x faster); max |ours - composite| {err:.3g}")
        # (c) host time of one eager call (20 calls behind a busy GPU), and its launches
        host = sorted(host_time_us(lambda: call(tri)) for _ in range(7))
        mm = torch.cuda.max_memory_allocated()
        host_comp = sorted(host_time_us(composite) for _ in range(3))
        host_mm = sorted(host_time_us(lambda: torch.mm(mat["routed"], up.t())) for _ in range(3))
        inner, spent = KL.Variant.__call__, []

        def timed(self, grid, *args):
            t1 = time.perf_counter()
            try:
                return inner(self, grid, *args)
            finally:
                spent.append((time.perf_counter() - t1) * 1e6)

        KL.Variant.__call__ = timed
        try:
            per_call = []
            for _ in range(30):
                spent.clear()
                call(tri)
                per_call.append((sum(spent), len(spent)))
            torch.cuda.synchronize()
        finally:
            KL.Variant.__call__ = inner
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call(tri)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        r["host"] = {"median_us": statistics.median(host), "min_us": host[0], "samples_us": host,
                     "compiled_composite_us": statistics.median(host_comp), "torch_mm_us": statistics.median(host_mm),
                     "gpu_kernels": len(kernels), "kernel_names": sorted(set(kernels)),
                     "triton_launch_us": statistics.median(t for t, _ in per_call),
                     "triton_launches": per_call[0][1], "max_memory_allocated": mm,
                     "method": "CPU wall time of 20 calls enqueued behind ~1 s of GPU work, / 20; median of 7"}
        say(f"(c) M={M} eager host time {r['host']['median_us']:.1f} us (min {host[0]:.1f}); compiled composite "
            f"{r['host']['compiled_composite_us']:.1f} us, a plain torch.mm {r['host']['torch_mm_us']:.1f} us; "
            f"{len(kernels)} GPU kernels, {per_call[0][1]} Triton launches take "
            f"{r['host']['triton_launch_us']:.1f} us")
        out[str(M)] = r
        mat.clear()
    return out


def part_d(ms, W, budget, say):
    from k3tail.tiers import Tier

    cfg_kw = dict(max_tokens=max(ms), **K3)
    from k3tail.config import TailConfig

    cfg = TailConfig(**cfg_kw)
    new = BG.Rig(W, cfg, multiproc=False, prefix="bench.prefill.new")
    old = BG.Rig(W, cfg, multiproc=False, prefix="bench.prefill.old", world=new.world,
                 module_kwargs={"large_m": "allreduce"})
    rows = cfg.hidden // W
    wts = [BG.rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=rows, copies=2, dtype=cfg.dtype,
                          device=new.device, seed=7 + r) for r in range(W)]
    out = {}
    for M in ms:
        ins = [BG.rank_inputs(M=M, device=new.device, seed=M + r, deferred=True, dtype=cfg.dtype, **K3)
               for r in range(W)]
        res = {}
        for name, rig in (("sharded", new), ("allreduce", old)):
            def step(i, rig=rig):
                return rig.run(lambda k: rig.mods[k](**ins[k], norm_weight=wts[k][0], up_weight=wts[k][1][i % 2],
                                                     graph_phase=True, tier=Tier.FUSED_LANE_AR))
            res[name] = BT.time_graph(step, budget_s=budget, max_calls=2)
            res[name]["bytes_per_rank"], res[name]["bytes_formula"] = traffic.bytes_per_rank(
                name, M=M, W=W, L=cfg.latent, H=cfg.hidden, world="loopback")
        res["speedup"] = ratio(res["allreduce"]["median_us"], res["sharded"]["median_us"])
        res["bytes_group"] = traffic.table(M=M, W=W, L=cfg.latent, H=cfg.hidden)
        say(f"(d) W={W} M={M}: sharded {res['sharded']['median_us']:.0f} us vs allreduce "
            f"{res['allreduce']['median_us']:.0f} us ({res['speedup']:.2f}x)")
        out[str(M)] = res
        ins.clear()  # free this M's inputs before the next
    new.close()
    old.close()
    return out


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--name", default="prefill", help="result files <out>/<name>.json and .png")
    ap.add_argument("--m", type=_ints, default=[1, 1024, 8192])
    ap.add_argument("--loopback-m", type=_ints, default=[1024, 2048, 4096, 8192])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=0.5)
    ap.add_argument("--parts", default="a,b,d")
    ap.add_argument("--chain-above", type=int, default=None,
                    help="(b) also time a module whose projection runs the single K chain above this M "
                         "(projection.FAST_CHAIN_ABOVE; the staged fast-mode arithmetic of issue 29)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefill needs a CUDA GPU", file=sys.stderr)
        return 2
    say = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    parts = {p.strip() for p in args.parts.split(",")}
    res = {}
    if "a" in parts:
        res["finalize_w1"] = part_a(args.m, args.budget_s, say)
    if "b" in parts:
        res["tail_w1"] = part_b_c(args.m, args.budget_s, say, chain_above=args.chain_above)
    if "d" in parts:
        res[f"loopback_w{args.world_size}"] = part_d(args.loopback_m, args.world_size, args.budget_s, say)
    targets = []
    a = res.get("finalize_w1", {}).get("8192")
    if a:
        targets.append(verdict(a["fraction_of_floor"] >= 0.6, f"finalize M=8192 at {100 * a['fraction_of_floor']:.0f}% "
                                                             f"of its read-bandwidth floor (target >= 60%)"))
        targets.append(verdict(a["speedup_vs_compile"] >= 3, f"finalize M=8192 {a['speedup_vs_compile']:.2f}x "
                                                            f"torch.compile (target >= 3x)"))
    b = res.get("tail_w1", {}).get("8192")
    if b:
        targets.append(verdict(b["deferred_over_materialized"] <= 1.2, f"K3MoETail W=1 M=8192 deferred "
                               f"{b['deferred_over_materialized']:.2f}x materialized (target <= 1.2x)"))
    for M, want in (("1024", 1.3), ("8192", 1.5)):  # issue 19: eager, against the compiled composite
        e = res.get("tail_w1", {}).get(M)
        if e:
            targets.append(verdict(e["eager_speedup_vs_compiled"] >= want, f"K3MoETail W=1 eager M={M} "
                                   f"{e['eager_speedup_vs_compiled']:.2f}x the compiled composite (target >= {want}x)"))
        if e and "chain" in e:
            ch = e["chain"]
            say(f"INFO K3MoETail W=1 eager M={M} with the chain above {ch['chain_above']}: "
                f"{ch['eager_speedup_vs_compiled']:.2f}x the compiled composite (target >= {want}x if it becomes "
                f"the default)")
    for M, e in res.get("tail_w1", {}).items():  # issue 19: host time of one eager call <= 100 us
        targets.append(verdict(e["host"]["median_us"] <= 100, f"eager host time M={M} {e['host']['median_us']:.0f} us, "
                               f"{e['host']['gpu_kernels']} kernels (target <= 100 us)"))
    d = res.get(f"loopback_w{args.world_size}")
    if d:
        worst = min(v["speedup"] for v in d.values())
        targets.append(verdict(worst >= 3, f"loopback W={args.world_size} sharded vs allreduce: worst "
                               f"{worst:.2f}x over M={list(d)} (target >= 3x)"))
    t8 = traffic.table(M=8192, W=8, L=K3["latent"], H=K3["hidden"])
    rb = t8["sharded"]["bytes"] / t8["bf16_lane"]["bytes"]
    targets.append(verdict(rb <= 1.2, f"bytes at M=8192 W=8: sharded {t8['sharded']['MB']} MB = {rb:.2f}x the bf16 "
                           f"lane's {t8['bf16_lane']['MB']} MB (target <= 1.2x); "
                           f"allreduce path {t8['allreduce']['MB']} MB"))
    for t in targets:
        say("TARGET " + t)
    payload = {**BR.results_meta(loopback=True), "what": __doc__.split("\n\n")[0], "shape": K3, "results": res,
               "targets": targets, "bandwidth_floor_bytes_per_s": BW, "bytes_m8192_w8": t8,
               "seconds": time.perf_counter() - t0, "figures": []}
    series = {}
    if a:
        series["finalize triton"] = [(int(M), v["triton"]["median_us"]) for M, v in res["finalize_w1"].items()]
        series["finalize torch.compile"] = [(int(M), v["torch_compile_plain"]["median_us"])
                                            for M, v in res["finalize_w1"].items()]
    if b:
        series["K3MoETail W=1 deferred"] = [(int(M), v["deferred"]["median_us"]) for M, v in res["tail_w1"].items()]
        series["compiled composite W=1"] = [(int(M), v["compiled_composite"]["median_us"])
                                            for M, v in res["tail_w1"].items()]
        chain = [(int(M), v["chain"]["graph"]["median_us"]) for M, v in res["tail_w1"].items() if "chain" in v]
        if chain:
            series[f"K3MoETail W=1 chain above {args.chain_above}"] = chain
    if d:
        series[f"W={args.world_size} sharded"] = [(int(M), v["sharded"]["median_us"]) for M, v in d.items()]
        series[f"W={args.world_size} allreduce (old)"] = [(int(M), v["allreduce"]["median_us"]) for M, v in d.items()]
    png = BR.line_plot(series, os.path.join(args.out, f"{args.name}.png"), title="k3tail large-M tail (H200)",
                      xlabel="M (tokens)", ylabel="us per layer (median, graph replay)")
    if png:
        payload["figures"].append(png.name)
    path = BR.write_results(args.name, payload, args.out)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
