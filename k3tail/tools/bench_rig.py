"""The tier map's rig: per-rank inputs and weights, the ranks of one W with their modules
(:class:`Rig`), and :func:`bench_world` (every possible tier timed at every M, with the bytes it
moves).  Used by ``k3tail bench``, ``k3tail tune`` and the scripts in ``bench/``.

:func:`bench_world` looks up ``time_graph`` / ``time_eager`` on :mod:`k3tail.tools.timing` at call
time, so whoever replaces them there (the CPU tests' fake timers) reaches every point timed here.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from k3tail.tools import timing, traffic


def generator(device, seed) -> torch.Generator:
    """A seeded generator on ``device`` (inputs are drawn where they are used)."""
    return torch.Generator(device=device).manual_seed(int(seed))


def rank_inputs(*, M: int, hidden: int, latent: int, top_k: int, dtype, device, seed: int,
                deferred: bool) -> Dict[str, torch.Tensor]:
    """One rank's tail inputs, drawn on the GPU: prefix_hidden, shared, and either routed
    ``[M, latent]`` or the deferred triple (``expert_out [M*top_k, latent]`` in permuted
    order, fp32 weights, int32 idx, no skipped slots: the worst case for the finalize)."""
    g = generator(device, seed)
    out = {
        "prefix_hidden": torch.randn(M, hidden, generator=g, device=device).to(dtype),
        "shared": (torch.randn(M, hidden, generator=g, device=device) * 0.5).to(dtype),
    }
    if deferred:
        R = M * top_k
        out["expert_out"] = torch.randn(R, latent, generator=g, device=device).to(dtype)
        out["expert_weights"] = torch.rand(M, top_k, generator=g, device=device) * (2.0 / top_k)
        out["expanded_idx"] = torch.randperm(R, generator=g, device=device).to(torch.int32).view(M, top_k)
    else:
        out["routed"] = torch.randn(M, latent, generator=g, device=device).to(dtype)
    return out


def rank_weights(*, hidden: int, latent: int, up_rows: int, copies: int, dtype, device, seed: int):
    """``norm_weight [latent]`` and ``copies`` distinct ``up_weight [up_rows, latent]`` (one per
    call of a graph, so consecutive calls do not find their weight in L2)."""
    g = generator(device, seed)
    norm_weight = (1.0 + 0.1 * torch.randn(latent, generator=g, device=device)).to(dtype)
    ups = [(torch.randn(up_rows, latent, generator=g, device=device) / math.sqrt(latent)).to(dtype)
           for _ in range(copies)]
    return norm_weight, ups


GRAPH_ONLY = ("TAIL_FUSION", "CUTE_FINALIZE")  # tiers that engage only in the graph phase


def tier_ranges(caps, cfg) -> Dict[str, tuple]:
    """``{tier name: (min M, max M)}`` for the tiers the agreed caps make possible.
    FUSED_LANE_AR: with the lane collective (``fused_ar``), or with the sharded large-M path
    alone (``large_m``: a forced FUSED_LANE_AR runs it at every M above the lane, here all)."""
    out = {"SEPARATE_REDUCE": (1, cfg.max_tokens)}
    if caps.fused_ar or caps.solo or caps.large_m == "sharded":
        out["FUSED_LANE_AR"] = (1, cfg.max_tokens)
    if caps.tail_fusion_max_tokens > 0:
        # the capacity the tail was built for (a tuned threshold may have lowered the caps)
        out["TAIL_FUSION"] = (1, max(caps.tail_fusion_max_tokens, min(cfg.tail_max_tokens, cfg.max_tokens)))
    if caps.cute_max_tokens > 0:
        out["CUTE_FINALIZE"] = (1, caps.cute_max_tokens)
    if caps.multimem:
        out["MULTIMEM_AR"] = (caps.multimem_min_tokens, min(caps.multimem_max_tokens, cfg.max_tokens))
    return out


class Rig:
    """The ranks of one W with their modules: a loopback world (``multiproc=False``: W virtual
    ranks on one GPU, ``world`` given or built) or this process's rank of a torchrun group."""

    def __init__(self, W: int, cfg, *, multiproc: bool, prefix: str = "layers.0", world=None,
                 module_kwargs: Optional[Dict[str, Any]] = None):
        from k3tail.module import K3MoETail

        kw = dict(module_kwargs or {})
        self.W, self.cfg, self.multiproc = W, cfg, multiproc
        if multiproc:
            import torch.distributed as dist

            self.world = None
            self.ranks = [dist.get_rank()]
            self.mods = [K3MoETail(cfg, None, prefix=prefix, **kw)]
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            from k3tail.runtime.loopback import LoopbackWorld

            self.world = world if world is not None else LoopbackWorld(W)
            self.ranks = list(range(W))
            self.mods = self.world.build(lambda r: K3MoETail(cfg, self.world.group(r), prefix=prefix, **kw))
            self.device = self.world.device
        self.caps = self.mods[0].caps

    def run(self, fn: Callable[[int], Any], warm: bool = True) -> list:
        """``fn(i)`` for every local rank index i (loopback: on each rank's stream).

        ``warm=False`` (timed eager iterations, after warm-up calls compiled every variant):
        skip ``LoopbackWorld.run``'s compile-only pass, whose torch ops would otherwise run
        for real a second time inside the measured interval."""
        if self.world is None:
            return [fn(0)]
        return self.world.run(fn, warm=warm)

    def close(self):
        self.mods = None
        self.world = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def up_rows(cfg, W: int) -> int:
    return cfg.hidden // W if cfg.shard_up_proj else cfg.hidden


def bench_world(rig: Rig, ms: Sequence[int], *, tiers: Optional[Sequence[str]], phases: Sequence[str],
                deferred: bool, budget_s: float, max_calls: int, seed: int = 0, baselines: bool = True,
                deadline: Optional[float] = None, baseline_rig: Optional[Rig] = None,
                progress: Callable[[str], None] = print) -> Dict[str, Any]:
    """Time every possible tier (and the cuBLAS projection) at every M for one W.

    ``deadline`` (a ``time.perf_counter()`` value): points not started by then are recorded
    as skipped (the decision is rank 0's under torchrun, so every rank skips the same).
    ``baseline_rig``: the same ranks built with ``large_m="allreduce"`` (the large-M path before
    the sharded one); above the lane capacity its FUSED_LANE_AR is timed as the baseline
    ``lane_large_m_allreduce`` in the same run.  Every point carries the bytes one rank moves
    per layer (:mod:`k3tail.tools.traffic`)."""

    def out_of_time() -> bool:
        return deadline is not None and bool(timing.rank_uniform_int(int(time.perf_counter() > deadline)))

    from k3tail.ops.projection import project
    from k3tail.tiers import Tier

    time_graph, time_eager = timing.time_graph, timing.time_eager  # looked up now: see the module docstring
    cfg, W = rig.cfg, rig.W
    world_kind = "loopback" if getattr(rig, "world", None) is not None else "group"
    elt = torch.empty((), dtype=cfg.dtype).element_size()
    ranges = tier_ranges(rig.caps, cfg)
    if tiers:
        ranges = {t: r for t, r in ranges.items() if t in tiers}
    dev = rig.device
    rows = up_rows(cfg, W)
    weights = [rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=rows, copies=max_calls,
                            dtype=cfg.dtype, device=dev, seed=seed + 7919 * r) for r in rig.ranks]
    points, base_pts, skipped = [], [], []
    selected = {ph: {} for ph in ("graph", "eager")}
    for M in ms:
        for ph in ("graph", "eager"):
            selected[ph][str(M)] = rig.mods[0].tier_for(M, ph == "graph").name
        inputs = [rank_inputs(M=M, hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, dtype=cfg.dtype,
                              device=dev, seed=seed + 1000 * M + r, deferred=deferred) for r in rig.ranks]
        for tname, (lo, hi) in ranges.items():
            tier = Tier[tname]
            why = f"M outside the tier's range {lo}..{hi}" if not lo <= M <= hi else None
            if why is None:
                why = rig.mods[0].why_not(tier, M)
            if why is None and out_of_time():
                why = "time budget (--max-seconds) exhausted"
            if why is not None:
                skipped.append({"tier": tname, "M": M, "why": why})
                continue
            for phase in phases:
                if phase == "eager" and tname in GRAPH_ONLY:
                    continue
                graph_phase = phase == "graph"

                def step(i, tier=tier, graph_phase=graph_phase, warm=True, inputs=inputs):
                    return rig.run(lambda k: rig.mods[k](
                        **inputs[k], norm_weight=weights[k][0], up_weight=weights[k][1][i % len(weights[k][1])],
                        graph_phase=graph_phase, tier=tier), warm=warm)

                try:
                    if graph_phase:
                        res = time_graph(step, max_calls=max_calls, budget_s=budget_s)
                    else:
                        res = time_eager(lambda i, step=step: step(i, warm=False), warm_step=step,
                                         budget_s=budget_s)
                except Exception as e:  # record and go on: one broken tier must not lose the map
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    skipped.append({"tier": tname, "M": M, "phase": phase, "why": f"{type(e).__name__}: {e}"})
                    progress(f"  W={W} M={M:>5} {tname:<16} {phase:<5} FAILED: {type(e).__name__}: {e}")
                    continue
                points.append({"tier": tname, "M": M, "phase": phase, **res})
                progress(f"  W={W} M={M:>5} {tname:<16} {phase:<5} median {res['median_us']:9.2f} us  "
                         f"p99 {res['p99_us']:9.2f} us  ({res['replays']} x {res['calls']} calls)")
        lane_cap = rig.caps.lane_max_tokens if rig.caps.fused_ar else 0
        if baseline_rig is not None and M > lane_cap and "FUSED_LANE_AR" in ranges and not out_of_time():
            for phase in phases:
                def old(i, graph_phase=phase == "graph", warm=True, inputs=inputs):
                    return baseline_rig.run(lambda k: baseline_rig.mods[k](
                        **inputs[k], norm_weight=weights[k][0], up_weight=weights[k][1][i % len(weights[k][1])],
                        graph_phase=graph_phase, tier=Tier.FUSED_LANE_AR), warm=warm)
                try:
                    res = (time_graph(old, max_calls=max_calls, budget_s=budget_s) if phase == "graph" else
                           time_eager(lambda i: old(i, warm=False), warm_step=old, budget_s=budget_s))
                except Exception as e:  # noqa: BLE001 - recorded like a broken tier
                    skipped.append({"tier": "lane_large_m_allreduce", "M": M, "phase": phase,
                                    "why": f"{type(e).__name__}: {e}"})
                    continue
                b, f = traffic.bytes_per_rank("allreduce", M=M, W=W, L=cfg.latent, H=cfg.hidden, e=elt,
                                              world=world_kind, gather_output=cfg.shard_up_proj)
                base_pts.append({"name": "lane_large_m_allreduce", "M": M, "phase": phase, **res,
                                 "bytes_per_rank": b, "bytes_formula": f})
                progress(f"  W={W} M={M:>5} {'old large-M':<16} {phase:<5} median {res['median_us']:9.2f} us")
        if not baselines or out_of_time():
            inputs = None  # release this M's tensors before the next M allocates its own
            continue
        # cuBLAS projection baseline: a bf16 GEMM of the same shape on its own (graph replay)
        normed = [torch.randn(M, cfg.latent, device=dev, generator=generator(dev, seed + r)).to(cfg.dtype)
                  for r in rig.ranks]

        def gemm(i, normed=normed):
            return rig.run(lambda k: torch.matmul(normed[k], weights[k][1][i % len(weights[k][1])].t()))

        # k3tail.project: the same GEMM with the tiers' epilogue (fp32 prefix + shared, one rounding)
        cols = [slice(rk * rows, (rk + 1) * rows) if cfg.shard_up_proj else slice(0, cfg.hidden)
                for rk in rig.ranks]  # the columns rank rk's projection produces
        pre_all = [inputs[j]["prefix_hidden"][:, cols[j]].contiguous() for j in range(len(rig.ranks))]
        shs_all = [inputs[j]["shared"][:, cols[j]].float().contiguous() for j in range(len(rig.ranks))]

        def proj(i, tactics=None, normed=normed, pre=pre_all, shs=shs_all):
            return rig.run(lambda k: project(normed[k], weights[k][1][i % len(weights[k][1])], prefix_hidden=pre[k],
                                             shared_sum=shs[k], out_dtype=cfg.dtype, tactics=tactics))

        variants = [("cublas_projection", "cuBLAS proj.", gemm), ("k3tail_project", "k3tail.project", proj)]
        for name, label, fn in variants:
            try:
                res = time_graph(fn, max_calls=max_calls, budget_s=budget_s / 2)
                base_pts.append({"name": name, "M": M, "phase": "graph", **res})
                progress(f"  W={W} M={M:>5} {label:<16} graph median {res['median_us']:9.2f} us")
            except Exception as e:
                skipped.append({"tier": name, "M": M, "why": f"{type(e).__name__}: {e}"})
        inputs = normed = pre_all = shs_all = None  # release this M's tensors before the next M
    # bytes one rank moves per layer: the tier's algorithm (above the lane capacity, the large-M path)
    large_m = rig.mods[0].large_m
    lane_cap = rig.caps.lane_max_tokens if rig.caps.fused_ar else 0
    for p in points:
        kind = large_m if p["tier"] == "FUSED_LANE_AR" and p["M"] > lane_cap else p["tier"]
        p["bytes_per_rank"], p["bytes_formula"] = traffic.bytes_per_rank(
            kind, M=p["M"], W=W, L=cfg.latent, H=cfg.hidden, e=elt, world=world_kind,
            gather_output=cfg.shard_up_proj)
    # ratios against SEPARATE_REDUCE at the same (M, phase)
    ref = {(p["M"], p["phase"]): p["median_us"] for p in points if p["tier"] == "SEPARATE_REDUCE"}
    for p in points:
        r = ref.get((p["M"], p["phase"]))
        p["speedup_vs_separate_reduce"] = (r / p["median_us"]) if r and p["median_us"] else None
    for m in rig.mods:
        check_ops(m)
    return {"world_size": W, "caps": caps_dict(rig.caps), "tier_ranges": ranges, "points": points,
            "baselines": base_pts, "selected": selected, "skipped": skipped,
            "up_weight_rows_per_rank": rows,
            "large_m_bytes": {str(M): traffic.table(M=M, W=W, L=cfg.latent, H=cfg.hidden, e=elt)
                              for M in ms if M > lane_cap}}


def caps_dict(caps) -> Dict[str, Any]:
    """A TailCaps (or a stand-in with the same attributes) as a dict."""
    from dataclasses import asdict, is_dataclass

    return asdict(caps) if is_dataclass(caps) else dict(vars(caps))


def check_ops(mod) -> None:
    """Raise what a timed-out GPU wait left behind: ``check()`` of every op ``mod`` allocated
    (``K3MoETail.context``; a kernel that timed out exits and poisons its workspace, and the
    error surfaces only at a check or the next call)."""
    ctx = getattr(mod, "context", None)
    for op in (vars(ctx).values() if ctx is not None else ()):
        check = getattr(op, "check", None)
        if callable(check):
            check()
