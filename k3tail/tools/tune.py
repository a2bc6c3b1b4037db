"""``k3tail tune``: sweep kernel tactics and tier crossovers; write the tactic table (DESIGN §7).

GPU only.  For every W of ``--world-sizes`` (loopback: W virtual ranks on one GPU) and the
shape given (default K3: H 7168, L 3584, top-k 16, bf16):

1. **Tactics.**  For each kernel (``--kernels``; default LatentTail, LaneAllReduce, project)
   a coordinate descent over the tactic keys its op accepts, starting from the op's own
   default: one key at a time, each candidate value timed by CUDA-graph replay at a few M
   (score = sum of the median per-call times), the best kept before the next key.  A
   candidate the op rejects (ValueError) or that fails/times out is skipped and reported.
   ``--full`` widens the value lists and the M sets.
1. **Tactics** are swept by :mod:`k3tail.tools.tune_tactics`.
2. **Crossovers** (:mod:`k3tail.tools.tune_crossovers`).  A ``K3MoETail`` is built with generous
   capacities and the tactics of step 1 (earlier thresholds ignored), and every possible tier
   is timed (graph replay, forced ``tier=``) on a grid of M; a second one built with
   ``lane_max_tokens=0, large_m="sharded"`` times the
   sharded large-M path at every M (its FUSED_LANE_AR, labelled ``LARGE_M_SHARDED``).  The
   table records where the selector's thresholds should sit: ``tail_fusion_max_tokens``
   (largest M up to which TAIL_FUSION beats the tier the selector would otherwise take, at
   every measured M), ``lane_max_tokens`` (largest M up to which the Lamport lane beats what
   FUSED_LANE_AR runs above it: the sharded path, or where the sharded rig failed SEPARATE_REDUCE,
   the proxy of the grouped fp32 all-reduce) and, with the sharded rig, ``large_m_min_tokens``
   (smallest M from which on the sharded path beats SEPARATE_REDUCE at every measured M;
   twice the largest grid M if it never does).  The selector applies the ``max_tokens`` ones
   as ``min(capacity, threshold)``, ``large_m_min_tokens`` as is.

Keys: ``(kernel, device, SM, Triton, W, shape)`` with ``shape =
k3tail.tuning.shape_string(H=, L=, K=, dtype=)``, exactly what ``K3MoETail`` looks up; the
crossovers under ``k3tail.tuning.CROSSOVER_KERNEL``.  Results merge into ``--out`` (default:
the user table, ``$XDG_CONFIG_HOME/k3tail/tactics.json`` or ``~/.config/k3tail/tactics.json``,
which the package loads ahead of the table it ships: ``k3tail.tuning.user_table_path``; to
update the shipped table, ``--out k3tail/tables/tactics.json`` in a checkout): entries for other
keys are kept.  A loopback measurement shares one GPU among W ranks; entries say so
(``info.loopback``).

The default run is sized to finish in about 4 minutes on an H200 (``--max-seconds``,
default 200: when the budget runs out, the remaining candidates are skipped and said so;
what was measured is still written).

Besides the table, every run writes a sweep report to ``--out-dir`` (default
``bench/results``): ``tune_<device>.json`` (every candidate's tactic and per-M medians, the
default and the winner, the crossover points and thresholds, with device, commit, date and
versions) and ``tune_<device>.png`` (``tune_plot``).  The table keeps only the winners.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from k3tail import tuning as T
from k3tail.tools import bench_results
from k3tail.tools import tune_crossovers as crossovers
from k3tail.tools import tune_tactics as tactics
from k3tail.tools.bench_results import TIER_COLORS, pyplot, save_figure, slug, write_results
from k3tail.tools.options import (DTYPES, GPU_ONLY_MSG, UsageError, add_loopback_arguments, int_list,
                                  non_negative_float, positive_float)

DEFAULT_KERNELS = ("LatentTail", "LaneAllReduce", "project")


def add_arguments(parser):
    parser.description = (parser.description or "") + ". GPU only (loopback on one GPU)."
    add_loopback_arguments(parser)
    parser.add_argument("--kernels", type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
                        default=list(DEFAULT_KERNELS),
                        help=f"kernels to sweep, comma-separated (default {','.join(DEFAULT_KERNELS)}; "
                             f"known: {','.join(tactics.SPECS)}); 'none' for crossovers only")
    parser.add_argument("--full", action="store_true", help="wider sweeps and M sets (much longer)")
    parser.add_argument("--no-crossovers", action="store_true", help="tactics only")
    parser.add_argument("--crossover-m", type=int_list, default=None,
                        help="M grid for the tier crossovers (default 1,2,4,8,16,32,64,128,256; --full adds 512,1024)")
    parser.add_argument("--out", default=None,
                        help=f"table to write/merge into (default: the user table {T.user_table_path()}, "
                             f"which k3tail loads ahead of the shipped {T.SHIPPED_TABLE}; $K3TAIL_TUNING_TABLE "
                             f"overrides both)")
    parser.add_argument("--fresh", action="store_true", help="do not merge into the existing --out table")
    parser.add_argument("--budget-s", type=positive_float, default=0.05,
                        help="seconds of replays per timing (default %(default)s)")
    parser.add_argument("--timeout-s", type=positive_float, default=5.0,
                        help="peer wait timeout of the ops built for tuning (default %(default)s)")
    parser.add_argument("--max-seconds", type=non_negative_float, default=None,
                        help="overall time budget (default 200, or none with --full; 0 = none)")
    parser.add_argument("--out-dir", default="bench/results",
                        help="where the sweep report (every candidate's timings, the crossover points) goes "
                             "as tune_<device>.json + .png (default %(default)s); the table goes to --out")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def main(args) -> int:
    specs = tactics.SPECS  # looked up now: the CPU tests replace it there
    kernels = [] if args.kernels in (["none"], []) else list(args.kernels)
    bad = [k for k in kernels if k not in specs]
    if bad:
        raise UsageError(f"unknown kernel(s) {bad}; known: {list(specs)}")
    if not torch.cuda.is_available():
        print(GPU_ONLY_MSG.format(cmd="tune"), file=sys.stderr)
        return 2
    from k3tail.runtime.loopback import LoopbackWorld
    from k3tail.testing import no_multicast

    no_multicast()
    max_s = args.max_seconds if args.max_seconds is not None else (None if args.full else 200.0)
    budget = tactics.Budget(max_s or None)
    say = lambda s: print(s, flush=True)  # noqa: E731
    out = T.user_table_path() if args.out is None else Path(args.out)
    try:
        table = T.TacticTable() if args.fresh else T.load_table(out)
    except FileNotFoundError:
        table = T.TacticTable()
    fields = T.device_fields()
    meta = bench_results.results_meta(loopback=True)
    cfg_kwargs = dict(hidden=args.hidden, latent=args.latent, top_k=args.top_k, dtype=DTYPES[args.dtype])
    from k3tail.config import TailConfig

    cfg = TailConfig(**cfg_kwargs)
    xms = args.crossover_m or ([1, 2, 4, 8, 16, 32, 64, 128, 256] + ([512, 1024] if args.full else []))
    say(f"k3tail tune on {fields['device_name']} (SM {fields['sm']}, Triton {fields['triton']}), loopback "
        f"W={args.world_sizes}, H={cfg.hidden} L={cfg.latent} K={cfg.top_k} {args.dtype}; kernels {kernels}"
        f"{'' if args.no_crossovers else ', crossovers at M=' + str(xms)}; budget "
        f"{'none' if budget.end is None else f'{max_s:.0f} s'}")
    info_common = {"loopback": True, "commit": meta["commit"], "date": meta["date"], "torch": meta["torch"]}
    n_written = 0
    report = {**meta, "what": "k3tail tune sweep: every candidate tactic's graph-replay median per M (summed "
                              "into its score; the lowest score wins with 1% hysteresis) and the crossover "
                              "points, per loopback W", "table": str(out), "kernels": kernels,
              "shape": tactics.spec_shape(cfg), "crossover_m": None if args.no_crossovers else xms, "worlds": [],
              "figures": []}
    name = f"tune_{slug(meta['device'])}"
    for wi, W in enumerate(args.world_sizes):
        if W < 2 or cfg.hidden % (8 * W):
            say(f"[tune W={W}] skipped: W must be >= 2 and hidden a multiple of 8*W")
            continue
        world = LoopbackWorld(W)
        wrep: Dict[str, Any] = {"world_size": W, "kernels": {}, "crossovers": None}
        report["worlds"].append(wrep)
        # share the time left evenly among the remaining W; 60% of a W's share for the sweeps
        share = budget.left() / (len(args.world_sizes) - wi)
        sweep_deadline = tactics.Budget(None if math.isinf(share) else max(1.0, 0.6 * share))
        for ki, kname in enumerate(kernels):
            spec = specs[kname]
            # each remaining kernel gets an equal share of what is left of this W's sweep time
            kdl = tactics.Budget(None if sweep_deadline.end is None
                                 else max(0.5, sweep_deadline.left() / (len(kernels) - ki)))
            r = tactics.sweep_kernel(spec, world, cfg, full=args.full, timeout_s=args.timeout_s, budget_s=args.budget_s,
                             seed=args.seed, deadline=kdl, say=say)
            if r is not None:
                wrep["kernels"][spec.name] = {k: r[k] for k in ("tactic", "us", "default", "default_us", "skipped")}
                wrep["kernels"][spec.name]["trials"] = r.pop("trials")
                key = T.make_key(spec.name, world_size=W, shape=spec.shape(cfg), **fields)
                table.put(key, r.pop("tactic"), us=r.pop("us"), info={**info_common, **r})
                n_written += 1
        if not args.no_crossovers:
            try:
                x = crossovers.tune_crossovers(world, cfg_kwargs, xms, timeout_s=args.timeout_s, budget_s=args.budget_s,
                                    seed=args.seed, say=say, tactics_table=table)
            except Exception as e:  # noqa: BLE001
                say(f"[tune W={W} crossovers] FAILED: {type(e).__name__}: {e}")
                x = None
            wrep["crossovers"] = x
            if x is not None and x["thresholds"]:
                key = T.make_key(T.CROSSOVER_KERNEL, world_size=W, shape=tactics.spec_shape(cfg), **fields)
                table.put(key, x["thresholds"], info={**info_common, "points": x["points"], "caps": x["caps"],
                                                      "phase": "graph",  # the sharded rig's caps, why not
                                                      **{k: x[k] for k in ("sharded_caps", "notes") if x.get(k)}})
                n_written += 1
        del world
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        T.save_table(table, out)  # after every W: an interrupted run keeps what it measured
        write_results(name, {**report, "seconds": budget.elapsed()}, args.out_dir)
        say(f"[tune W={W}] done at {budget.elapsed():.0f} s; table saved to {out}")
    table.meta = {**table.meta, "written_by": "k3tail tune", "date": meta["date"], "commit": meta["commit"]}
    T.save_table(table, out)
    if not args.no_plot:
        png = tune_plot(report, Path(args.out_dir) / f"{name}.png",
                        title=f"k3tail tune: {meta['device']}, {report['shape']}, loopback")
        if png:
            report["figures"].append(png.name)
            say(f"wrote {png}")
    path = write_results(name, {**report, "seconds": budget.elapsed()}, args.out_dir)
    say(f"wrote {path}")
    say(f"k3tail tune: wrote {n_written} entries ({len(table)} in the table) to {out} in {budget.elapsed():.0f} s")
    return 0


def tune_plot(report: Dict[str, Any], path, *, title: str = "") -> Optional[Path]:
    """The sweep report as a grid: a row per W; a panel per kernel with every candidate's score
    (sum of medians over its M set) in the order measured, the default and the winner marked, a
    failed candidate as an x on the axis floor; a last panel with the crossover timings per tier
    against M and the thresholds written as dashed lines.  None when there is nothing to draw."""
    worlds = [w for w in report.get("worlds", []) if w.get("kernels") or w.get("crossovers")]
    if not worlds:
        return None
    plt = pyplot()
    if plt is None:
        return None
    kernels = sorted({k for w in worlds for k in w.get("kernels", {})})
    cols = len(kernels) + (1 if any(w.get("crossovers") for w in worlds) else 0)
    fig, axes = plt.subplots(len(worlds), cols, figsize=(4.2 * cols, 3.2 * len(worlds)), squeeze=False)
    for row, w in enumerate(worlds):
        W = w["world_size"]
        for col, kname in enumerate(kernels):
            ax = axes[row][col]
            k = w.get("kernels", {}).get(kname)
            ax.set_title(f"W={W} {kname}", fontsize=9)
            if not k:
                ax.text(0.5, 0.5, "not tuned", ha="center", va="center", transform=ax.transAxes)
                continue
            ok = [(i, t["score"]) for i, t in enumerate(k["trials"]) if t["score"] is not None]
            bad = [i for i, t in enumerate(k["trials"]) if t["score"] is None]
            ax.plot([i for i, _ in ok], [v for _, v in ok], "o", ms=4, color="tab:blue", label="candidate")
            if ok and ok[0][0] == 0:
                ax.plot([0], [ok[0][1]], "s", ms=7, mfc="none", color="black", label="default")
            best = [(i, t["score"]) for i, t in enumerate(k["trials"]) if t["tactic"] == k["tactic"]
                    and t["score"] is not None]
            if best:
                ax.plot([best[-1][0]], [best[-1][1]], "*", ms=12, color="tab:red",
                        label=f"chosen ({k['default_us'] / k['us']:.2f}x)" if k.get("us") else "chosen")
            if bad:
                lo = min((v for _, v in ok), default=1.0)
                ax.plot(bad, [lo * 0.9] * len(bad), "x", color="tab:gray", label="failed / rejected")
            ax.set(xlabel="candidate (order measured)", ylabel="sum of medians (us)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        if cols > len(kernels):
            ax = axes[row][-1]
            x = w.get("crossovers") or {}
            ax.set_title(f"W={W} tier crossovers (graph)", fontsize=9)
            pts = x.get("points", [])
            for tier in sorted({p["tier"] for p in pts}):
                tp = sorted((p["M"], p["median_us"]) for p in pts if p["tier"] == tier and p.get("median_us"))
                if tp:
                    ax.plot([m for m, _ in tp], [t for _, t in tp], marker="o", ms=3, label=tier,
                            color=TIER_COLORS.get(tier))
            top = max((p["M"] for p in pts), default=0)
            for name, m in (x.get("thresholds") or {}).items():
                if m and m > top:  # above the grid (the sharded path never won): said, not drawn
                    ax.text(0.02, 0.02, f"{name}={m} (above the grid)", fontsize=6, transform=ax.transAxes)
                elif m:
                    ax.axvline(m, ls="--", lw=1, color="black")
                    ax.text(m, 0.98, f" {name}={m}", rotation=90, va="top", fontsize=6,
                            transform=ax.get_xaxis_transform())
            if pts:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.legend(fontsize=7)
            ax.set(xlabel="tokens M", ylabel="us per layer (median)")
            ax.grid(True, which="both", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(plt, fig, path, dpi=110)
