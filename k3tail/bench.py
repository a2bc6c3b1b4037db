"""``k3tail bench``: the tier map.  Per-layer time of the K3 tail for every tier possible here,
against M and W, with the selector's choice marked and the baselines measured in the same run.

GPU only.  One GPU: each W runs as W virtual ranks in loopback (``k3tail.LoopbackWorld``):
one CUDA-graph replay (or one eager iteration) launches every virtual rank's kernels, so the
time of a replay is the time until the LAST rank finishes (the max over ranks, by
construction).  Note what loopback means for the numbers: the W ranks share one GPU's SMs and
HBM bandwidth (a loopback W=8 does 8 ranks' work on one GPU), so the times measure protocol
and launch overheads and the relative order of the tiers, not a W-GPU machine's absolute time.
Several GPUs: run under ``torchrun --nproc-per-node W -m k3tail.cli bench``; every process is a
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
figures) and ``<name>.png`` (the tier map).  The helpers ``results_meta``, ``write_results``,
``line_plot`` and ``tier_map_plot`` are shared with the bench scripts (``bench/plot.py``
re-exports them).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

log = logging.getLogger("k3tail")

DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192)
DEFAULT_W = (2, 4, 8)
GPU_ONLY_MSG = ("k3tail {cmd}: needs a CUDA GPU (it times CUDA-graph replay of the real kernels); "
                "no CUDA device is visible here. Run it on a GPU machine; on CPU use `k3tail demo`.")
REPO_ROOT = Path(__file__).resolve().parent.parent


# ============================================================== results: meta, JSON, plots
def git_commit(cwd=None) -> str:
    """``git rev-parse HEAD`` of the checkout (``+dirty`` if it has uncommitted changes to
    tracked files), or ``"unknown"``."""
    if os.environ.get("K3TAIL_COMMIT"):  # set by bench/gpu_check.sh: the device's copy has no .git
        return os.environ["K3TAIL_COMMIT"]
    cwd = str(cwd or REPO_ROOT)
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def results_meta(*, loopback: Optional[bool] = None, device=None) -> Dict[str, Any]:
    """What every results file records: device, gpus, loopback, commit, date, torch, triton
    (plus sm, cuda, host)."""
    import triton

    has_cuda = torch.cuda.is_available()
    if has_cuda:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        sm = f"{major}.{minor}"
    else:
        name, sm = "cpu", None
    return {
        "device": name,
        "gpus": torch.cuda.device_count() if has_cuda else 0,
        "loopback": loopback,
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sm": sm,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }


def _jsonable(x):
    import enum

    if isinstance(x, enum.Enum):  # before int: Tier is an IntEnum
        return x.name
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def write_results(name: str, payload: Dict[str, Any], out_dir="bench/results") -> Path:
    """Write ``payload`` (NaN/inf become null, enums their names) to ``out_dir/name.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(_jsonable(payload), indent=1) + "\n")
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except Exception as e:  # matplotlib is an optional dependency ([bench] extra)
        log.warning("matplotlib unavailable (%s): no plot written (pip install 'k3tail[bench]')", e)
        return None


def line_plot(series: Dict[str, Sequence], path, *, title: str = "", xlabel: str = "", ylabel: str = "",
              logx: bool = True, logy: bool = True) -> Optional[Path]:
    """One line per ``series[name] = [(x, y), ...]``; log2 x axis; PNG to ``path``."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in series.items():
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save_figure(plt, fig, path, dpi=120)


def _save_figure(plt, fig, path, *, dpi: int) -> Path:
    """Lay out, write the PNG (creating its folder) and close the figure."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


TIER_COLORS = {"TAIL_FUSION": "tab:red", "CUTE_FINALIZE": "tab:purple", "MULTIMEM_AR": "tab:green",
               "FUSED_LANE_AR": "tab:blue", "SEPARATE_REDUCE": "tab:gray", "cublas_projection": "black"}


def tier_map_plot(results: Dict[str, Any], path, *, title: str = "") -> Optional[Path]:
    """The tier map: one row per W, one column per phase (graph / eager); a line per tier
    (median us per call against M), the cuBLAS projection dashed, and the tier the selector
    picks at each M circled."""
    plt = _pyplot()
    if plt is None:
        return None
    worlds = results["worlds"]
    if not worlds:  # nothing measured (the first world failed): no figure
        return None
    phases = ("graph", "eager")
    fig, axes = plt.subplots(len(worlds), 2, figsize=(13, 4.2 * len(worlds)), squeeze=False)
    for row, wres in enumerate(worlds):
        W = wres["world_size"]
        for col, phase in enumerate(phases):
            ax = axes[row][col]
            pts = [p for p in wres["points"] if p["phase"] == phase and p.get("median_us") is not None]
            for tier in sorted({p["tier"] for p in pts}):
                tp = sorted((p["M"], p["median_us"]) for p in pts if p["tier"] == tier)
                ax.plot([m for m, _ in tp], [t for _, t in tp], marker="o", ms=3, label=tier,
                        color=TIER_COLORS.get(tier))
            for bname, ls, blabel in (("cublas_projection", "--", "cuBLAS projection only"),
                                      ("k3tail_project", ":", "k3tail.project only"),
                                      ("k3tail_project_torch_epilogue", "-.", "k3tail.project, torch epilogue"),
                                      ("k3tail_project_triton_epilogue", "-.", "k3tail.project, Triton epilogue")):
                base = sorted((b["M"], b["median_us"]) for b in wres.get("baselines", [])
                              if b["name"] == bname and b.get("median_us") is not None)
                if base and phase == "graph":
                    ax.plot([m for m, _ in base], [t for _, t in base], ls=ls, color="black", lw=1, label=blabel)
            chosen = wres.get("selected", {}).get(phase, {})
            first = True
            for m_str, tier in chosen.items():
                hit = [p["median_us"] for p in pts if p["M"] == int(m_str) and p["tier"] == tier]
                if hit:
                    ax.scatter([int(m_str)], hit, s=120, facecolors="none", edgecolors=TIER_COLORS.get(tier, "k"),
                               linewidths=2, label="selector's choice" if first else None, zorder=5)
                    first = False
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set(title=f"W={W}, {phase} phase", xlabel="tokens M", ylabel="us per layer (median)")
            ax.grid(True, which="both", alpha=0.3)
            if pts or base:
                ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    return _save_figure(plt, fig, path, dpi=110)


# ====================================================================== timing
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


def _rank_uniform_int(x: int) -> int:
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
               warmup: int = 2) -> Dict[str, Any]:
    """CUDA-graph replay timing of ``step(i)`` (one call; ``i`` picks the weight copy).

    Eager warm-up (compiles every kernel variant before capture), then a graph of ``calls``
    consecutive steps (about ``target_replay_us`` of work, at most ``max_calls``), replayed
    until about ``budget_s`` has passed (``min_replays``..``max_replays``).  Returns the
    summary of per-call times (replay time / calls) plus ``calls`` and ``replays``.
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
    calls = _rank_uniform_int(max(1, min(max_calls, round(target_replay_us / est_call_us))))
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
    replays = _rank_uniform_int(max(min_replays, min(max_replays, int(budget_s / est_replay_s))))
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
    iters = _rank_uniform_int(max(min_iters, min(max_iters, int(budget_s / est))))
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


# ====================================================================== inputs
def parse_ints(text: str) -> List[int]:
    """``"1,2,4"`` or ``"1 2 4"`` -> [1, 2, 4] (argparse type)."""
    import argparse

    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(int(seed))


def rank_inputs(*, M: int, hidden: int, latent: int, top_k: int, dtype, device, seed: int,
                deferred: bool) -> Dict[str, torch.Tensor]:
    """One rank's tail inputs, drawn on the GPU: prefix_hidden, shared, and either routed
    ``[M, latent]`` or the deferred triple (``expert_out [M*top_k, latent]`` in permuted
    order, fp32 weights, int32 idx, no skipped slots: the worst case for the finalize)."""
    g = _gen(device, seed)
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
    g = _gen(device, seed)
    norm_weight = (1.0 + 0.1 * torch.randn(latent, generator=g, device=device)).to(dtype)
    ups = [(torch.randn(up_rows, latent, generator=g, device=device) / math.sqrt(latent)).to(dtype)
           for _ in range(copies)]
    return norm_weight, ups


# ====================================================================== the tier map
def _tier_enum():
    from .tiers import Tier
    return Tier


GRAPH_ONLY = ("TAIL_FUSION", "CUTE_FINALIZE")


def tier_ranges(caps, cfg) -> Dict[str, tuple]:
    """``{tier name: (min M, max M)}`` for the tiers the agreed caps make possible."""
    out = {"SEPARATE_REDUCE": (1, cfg.max_tokens)}
    if caps.fused_ar:
        out["FUSED_LANE_AR"] = (1, cfg.max_tokens)
    if caps.tail_fusion_max_tokens > 0:
        # the capacity the tail was built for (a tuned threshold may have lowered the caps)
        out["TAIL_FUSION"] = (1, max(caps.tail_fusion_max_tokens, min(cfg.tail_max_tokens, cfg.max_tokens)))
    if caps.cute_max_tokens > 0:
        out["CUTE_FINALIZE"] = (1, caps.cute_max_tokens)
    if caps.multimem:
        out["MULTIMEM_AR"] = (caps.multimem_min_tokens, min(caps.multimem_max_tokens, cfg.max_tokens))
    return out


class _Rig:
    """The ranks of one W (loopback world or this process's rank) with their modules."""

    def __init__(self, W: int, cfg, *, multiproc: bool, prefix: str = "layers.0", world=None,
                 module_kwargs: Optional[Dict[str, Any]] = None):
        from .module import K3MoETail

        kw = dict(module_kwargs or {})
        self.W, self.cfg, self.multiproc = W, cfg, multiproc
        if multiproc:
            import torch.distributed as dist

            self.world = None
            self.ranks = [dist.get_rank()]
            self.mods = [K3MoETail(cfg, None, prefix=prefix, **kw)]
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            from .workspace import LoopbackWorld

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


def bench_world(rig: _Rig, ms: Sequence[int], *, tiers: Optional[Sequence[str]], phases: Sequence[str],
                deferred: bool, budget_s: float, max_calls: int, seed: int = 0, baselines: bool = True,
                deadline: Optional[float] = None, baseline_rig: Optional["_Rig"] = None,
                progress: Callable[[str], None] = print) -> Dict[str, Any]:
    """Time every possible tier (and the cuBLAS projection) at every M for one W.

    ``deadline`` (a ``time.perf_counter()`` value): points not started by then are recorded
    as skipped (the decision is rank 0's under torchrun, so every rank skips the same).
    ``baseline_rig``: the same ranks built with ``large_m="allreduce"`` (the large-M path before
    the sharded one); above the lane capacity its FUSED_LANE_AR is timed as the baseline
    ``lane_large_m_allreduce`` in the same run.  Every point carries the bytes one rank moves
    per layer (:mod:`k3tail.traffic`)."""

    def out_of_time() -> bool:
        return deadline is not None and bool(_rank_uniform_int(int(time.perf_counter() > deadline)))

    from . import traffic

    Tier = _tier_enum()
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
            possible = getattr(rig.mods[0], "possible", None)
            if why is None and callable(possible):
                why = possible(tier, M)
            if why is None and out_of_time():
                why = "time budget (--max-seconds) exhausted"
            if why is not None:
                skipped.append({"tier": tname, "M": M, "why": why})
                continue
            for phase in phases:
                if phase == "eager" and tname in GRAPH_ONLY:
                    continue
                graph_phase = phase == "graph"

                def step(i, tier=tier, graph_phase=graph_phase, warm=True):
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
                def old(i, graph_phase=phase == "graph", warm=True):
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
        # cuBLAS projection baseline: what every tier's GEMM costs on its own (graph replay)
        normed = [torch.randn(M, cfg.latent, device=dev, generator=_gen(dev, seed + r)).to(cfg.dtype)
                  for r in rig.ranks]

        def gemm(i):
            return rig.run(lambda k: torch.matmul(normed[k], weights[k][1][i % len(weights[k][1])].t()))

        # k3tail.project: the same GEMM with the tiers' epilogue (fp32 prefix + shared, one rounding)
        from .projection import project

        cols = [slice(rk * rows, (rk + 1) * rows) if cfg.shard_up_proj else slice(0, cfg.hidden)
                for rk in rig.ranks]  # the columns rank rk's projection produces
        pre = [inputs[k]["prefix_hidden"][:, cols[k]].contiguous() for k in range(len(rig.ranks))]
        shs = [inputs[k]["shared"][:, cols[k]].float().contiguous() for k in range(len(rig.ranks))]

        def proj(i, tactics=None):
            return rig.run(lambda k: project(normed[k], weights[k][1][i % len(weights[k][1])], prefix=pre[k],
                                             shared_sum=shs[k], out_dtype=cfg.dtype, tactics=tactics))

        def proj_te(i):  # the large-M path with the four-pass torch epilogue (same bits, the old default)
            return proj(i, {"epilogue": "torch"})

        variants = [("cublas_projection", "cuBLAS proj.", gemm), ("k3tail_project", "k3tail.project", proj)]
        if M > 16:
            variants.append(("k3tail_project_torch_epilogue", "project+torchEp", proj_te))
        for name, label, fn in variants:
            try:
                res = time_graph(fn, max_calls=max_calls, budget_s=budget_s / 2)
                base_pts.append({"name": name, "M": M, "phase": "graph", **res})
                progress(f"  W={W} M={M:>5} {label:<16} graph median {res['median_us']:9.2f} us")
            except Exception as e:
                skipped.append({"tier": name, "M": M, "why": f"{type(e).__name__}: {e}"})
        inputs = normed = pre = shs = None  # release this M's tensors before the next M
    # bytes one rank moves per layer: the tier's algorithm (above the lane capacity, the large-M path)
    large_m = getattr(rig.mods[0], "large_m", "sharded")
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
    mods = rig.mods
    for m in mods:
        check = getattr(m, "check", None)
        if callable(check):
            check()
    return {"world_size": W, "caps": _caps_dict(rig.caps), "tier_ranges": ranges, "points": points,
            "baselines": base_pts, "selected": selected, "skipped": skipped,
            "up_weight_rows_per_rank": rows,
            "large_m_bytes": {str(M): traffic.table(M=M, W=W, L=cfg.latent, H=cfg.hidden, e=elt)
                              for M in ms if M > lane_cap}}


def _caps_dict(caps) -> Dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    return asdict(caps) if is_dataclass(caps) else dict(vars(caps))


def make_config(args, max_tokens: int, W: int):
    from .module import TailConfig

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


# ====================================================================== CLI
def add_common_arguments(parser, *, world_sizes_default=DEFAULT_W):
    parser.add_argument("--world-sizes", type=parse_ints, default=list(world_sizes_default),
                        help="loopback world sizes, comma-separated (default %(default)s); ignored under "
                             "torchrun, where W is the number of processes")
    parser.add_argument("--hidden", type=int, default=7168, help="H (default K3: 7168)")
    parser.add_argument("--latent", type=int, default=3584, help="L (default K3: 3584)")
    parser.add_argument("--top-k", type=int, default=16, help="top-k (default K3: 16)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)


def add_arguments(parser):
    parser.description = (parser.description or "") + (
        ". GPU only: loopback on one GPU (--world-sizes), or one process per GPU under torchrun "
        "(torchrun --nproc-per-node W -m k3tail.cli bench).")
    add_common_arguments(parser)
    parser.add_argument("--m", type=parse_ints, default=list(DEFAULT_M),
                        help="token counts M, comma-separated (default %(default)s); M above a tier's "
                             "capacity is skipped for that tier")
    parser.add_argument("--tiers", type=lambda s: [t.strip().upper() for t in s.split(",") if t.strip()],
                        default=None, help="only these tiers (comma-separated names; default: all possible)")
    parser.add_argument("--phases", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                        default=["graph", "eager"], help="graph,eager (default both)")
    parser.add_argument("--routed", action="store_true",
                        help="feed materialized routed [M, L] instead of the deferred finalize triple")
    parser.add_argument("--budget-s", type=float, default=0.25,
                        help="seconds of replays per point (default %(default)s)")
    parser.add_argument("--max-calls", type=int, default=8,
                        help="tail calls per captured graph, each with its own weight (default %(default)s)")
    parser.add_argument("--out-dir", default="bench/results", help="where JSON and PNG go (default %(default)s)")
    parser.add_argument("--name", default=None, help="results file stem (default tier_map_<device>)")
    parser.add_argument("--no-plot", action="store_true", help="JSON only")
    parser.add_argument("--no-large-m-baseline", dest="large_m_baseline", action="store_false",
                        help="skip timing the large-M path before the sharded one (large_m='allreduce') "
                             "above the lane capacity")
    parser.add_argument("--lane-max-tokens", type=int, default=None,
                        help="lane collective capacity of the K3MoETail built (default: the module's)")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="peer wait timeout (default %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=240.0,
                        help="time budget: points not started by then are skipped and listed as such "
                             "(default %(default)s; 0 = none)")


def _slug(text: str) -> str:
    return "".join(c.lower() if c.isalnum() else "_" for c in text).strip("_") or "gpu"


def main(args) -> int:
    if not torch.cuda.is_available():
        print(GPU_ONLY_MSG.format(cmd="bench"), file=sys.stderr)
        return 2
    from .testing import no_multicast
    from .tiers import Tier

    no_multicast()
    bad = [t for t in (args.tiers or []) if t not in Tier.__members__]
    if bad:
        print(f"k3tail bench: unknown tier(s) {bad}; known: {list(Tier.__members__)}", file=sys.stderr)
        return 2
    bad = [p for p in args.phases if p not in ("graph", "eager")]
    if bad:
        print(f"k3tail bench: unknown phase(s) {bad}; known: graph, eager", file=sys.stderr)
        return 2
    multiproc = multiproc_world()
    world_sizes = [init_multiproc()] if multiproc else list(args.world_sizes)
    rank0 = (not multiproc) or int(os.environ.get("RANK", "0")) == 0
    say = (lambda s: print(s, flush=True)) if rank0 else (lambda s: None)
    ms = sorted(set(args.m))
    t_start = time.perf_counter()
    meta = results_meta(loopback=not multiproc)
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
            rig = _Rig(W, cfg, multiproc=multiproc, module_kwargs=kw)
            say(f"W={W}: built in {time.perf_counter() - t0:.1f} s; caps {rig.caps}; "
                f"tiers {list(tier_ranges(rig.caps, cfg))}")
            old = None
            lane_cap = rig.caps.lane_max_tokens if rig.caps.fused_ar else 0
            if (args.large_m_baseline and rig.caps.fused_ar and any(M > lane_cap for M in ms)
                    and (not args.tiers or "FUSED_LANE_AR" in args.tiers)):
                old = _Rig(W, cfg, multiproc=multiproc, prefix="layers.0.baseline",
                           module_kwargs={**kw, "large_m": "allreduce"})
            try:
                wres = bench_world(rig, ms, tiers=args.tiers, phases=args.phases, deferred=not args.routed,
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
    name = args.name or f"tier_map_{_slug(meta['device'])}"
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
                     "k3tail_project times every rank's k3tail.project (the same GEMM with the fp32 prefix + "
                     "shared epilogue and one rounding; above M = 16 its default one-pass Triton epilogue) alone, and "
                     "for M > 16 k3tail_project_torch_epilogue the same with the four-pass torch epilogue "
                     "(tactic epilogue='torch', same bits) "
                     "(loopback: the W ranks' GEMMs run concurrently "
                     "on the one GPU, as inside the tiers); lane_large_m_allreduce times FUSED_LANE_AR above the "
                     "lane capacity with the large-M path before the sharded one (large_m='allreduce': fp64 lane "
                     "all-reduce on process groups, fp32 one-shot in loopback)",
        "bytes": "bytes_per_rank: what one rank sends per layer in the point's algorithm (k3tail.traffic; "
                 "bytes_formula beside it, W ranks, M tokens, L latent, H hidden, e bytes of the 16-bit dtype); "
                 "large_m_bytes per world: the sharded path, the allreduce path and the seed's bf16 lane "
                 "all-reduce at each M above the lane capacity (process-group formulas)",
        "worlds": worlds,
        "incomplete": error,
        "figures": [],
        "seconds": time.perf_counter() - t_start,
    }
    if not args.no_plot:
        png = tier_map_plot(payload, Path(args.out_dir) / f"{name}.png",
                            title=f"k3tail tier map: {meta['device']}, H={args.hidden} L={args.latent} "
                                  f"K={args.top_k} {args.dtype}{', loopback' if not multiproc else ''}")
        if png:
            payload["figures"].append(png.name)
            say(f"wrote {png}")
    path = write_results(name, payload, args.out_dir)
    say(f"wrote {path}")
    _print_summary(worlds, say)
    say(f"total {time.perf_counter() - t_start:.1f} s")
    if error:
        say(f"INCOMPLETE: W={error['world_size']} failed ({error['error']}); the worlds before it are in {path}")
        return 1
    return 0


def _print_summary(worlds, say):
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
