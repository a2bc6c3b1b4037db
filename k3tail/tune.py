"""``k3tail tune``: sweep kernel tactics and tier crossovers; write the tactic table (DESIGN §7).

GPU only.  For every W of ``--world-sizes`` (loopback: W virtual ranks on one GPU) and the
shape given (default K3: H 7168, L 3584, top-k 16, bf16):

1. **Tactics.**  For each kernel (``--kernels``; default LatentTail, LaneAllReduce, project)
   a coordinate descent over the tactic keys its op accepts, starting from the op's own
   default: one key at a time, each candidate value timed by CUDA-graph replay at a few M
   (score = sum of the median per-call times), the best kept before the next key.  A
   candidate the op rejects (ValueError) or that fails/times out is skipped and reported.
   ``--full`` widens the value lists and the M sets.
2. **Crossovers.**  A ``K3MoETail`` is built with generous capacities and the tactics of
   step 1 (earlier thresholds ignored), and every possible tier is timed (graph replay, forced ``tier=``) on a grid of M; the table records where
   the selector's thresholds should sit: ``tail_fusion_max_tokens`` (largest M up to which
   TAIL_FUSION beats the tier the selector would otherwise take, at every measured M) and
   ``lane_max_tokens`` (largest M up to which the Lamport lane collective beats the fp32
   all-reduce path; SEPARATE_REDUCE is the proxy for FUSED_LANE_AR's grouped all-reduce
   path, which in loopback is the same two fp32 all-reduces).  The selector applies them
   as ``min(capacity, threshold)``.

Keys: ``(kernel, device, SM, Triton, W, shape)`` with ``shape =
k3tail.tuning.shape_string(H=, L=, K=, dtype=)``, exactly what ``K3MoETail`` looks up; the
crossovers under ``k3tail.tuning.CROSSOVER_KERNEL``.  Results merge into ``--out`` (default:
the table shipped in the package, ``k3tail/tables/tactics.json``): entries for other keys
are kept.  A loopback measurement shares one GPU among W ranks; entries say so
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
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import bench as B
from . import tuning as T

DEFAULT_KERNELS = ("LatentTail", "LaneAllReduce", "project")


# ==================================================================== kernel specs
class Spec:
    """How to build, feed and time one kernel's op with a given tactic (loopback world)."""

    name = ""
    per_rank = True  # False: a local op (no communication), timed on rank 0 only

    def ms(self, full: bool) -> List[int]:
        raise NotImplementedError

    def space(self, full: bool, W: int, cfg) -> Dict[str, List[Any]]:
        """Tactic key -> candidate values, in the order the descent visits them."""
        raise NotImplementedError

    def shape(self, cfg) -> str:
        return T.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)

    def build(self, world, cfg, tactic: dict, tag: str, timeout_s: float, max_tokens: int) -> list:
        """One op per rank (collective construction through ``world.build``)."""
        raise NotImplementedError

    def resolved(self, ops: list) -> dict:
        """The complete tactic the ops ended up with (their defaults filled in)."""
        raise NotImplementedError

    def step_for(self, world, ops, cfg, M: int, seed: int) -> Callable[[int], Any]:
        raise NotImplementedError


def _weights(world, cfg, copies, seed):
    W = world.world_size
    return [B.rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=cfg.hidden // W, copies=copies,
                           dtype=cfg.dtype, device=world.device, seed=seed + 7919 * r) for r in range(W)]


def _inputs(world, cfg, M, seed, deferred=True):
    return [B.rank_inputs(M=M, hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, dtype=cfg.dtype,
                          device=world.device, seed=seed + 1000 * M + r, deferred=deferred)
            for r in range(world.world_size)]


class LatentTailSpec(Spec):
    name = "LatentTail"

    def ms(self, full):
        return [1, 2, 4, 8, 16] if full else [1, 16]

    def space(self, full, W, cfg):
        if full:
            return {"b_block_n": [16, 32, 64, 128], "b_split_k": [1, 2, 4, 8, 16], "b_block_k": [64, 128, 256],
                    "b_warps": [2, 4, 8], "b_stages": [2, 3, 4, 5], "b_gemv_max_m": [0, 1, 2, 4],
                    "b_gemv_rows": [4, 8, 16], "b_gemv_warps": [4, 8, 16], "a_slices": [1, 2, 4, 7, 14, 28],
                    "c_block": [512, 1024, 2048], "c_programs": [4, 8, 16, 32, 64]}
        return {"b_block_n": [16, 32, 64], "b_split_k": [1, 2, 4, 8], "b_warps": [4, 8], "b_gemv_max_m": [0, 4],
                "a_slices": [4, 7, 14], "c_programs": [8, 16, 32]}

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        from .tail import LatentTail

        return world.build(lambda r: LatentTail(world.group(r), hidden=cfg.hidden, latent=cfg.latent,
                                                top_k=cfg.top_k, eps=cfg.eps, max_tokens=16, dtype=cfg.dtype,
                                                key=f"k3tail.tune.{tag}", timeout_s=timeout_s,
                                                tactics=tactic or None))

    def resolved(self, ops):
        return dict(ops[0].tactics)

    def step_for(self, world, ops, cfg, M, seed):
        ins = _inputs(world, cfg, M, seed)
        ws = _weights(world, cfg, 8, seed)

        def step(i):
            return world.run(lambda r: ops[r](prefix=ins[r]["prefix_hidden"], shared=ins[r]["shared"],
                                              norm_weight=ws[r][0], up_weight=ws[r][1][i % 8],
                                              expert_out=ins[r]["expert_out"],
                                              expert_weights=ins[r]["expert_weights"],
                                              expanded_idx=ins[r]["expanded_idx"]))
        return step


class _FusedSpec(Spec):
    def space(self, full, W, cfg):
        wp2 = 1 << max(0, (W - 1).bit_length())
        blocks = [b for b in ((128, 256, 512, 1024, 2048, 4096) if full else (256, 512, 1024))
                  if b * wp2 <= (32768 if full else 16384)]
        return {"block": blocks, "num_warps": [2, 4, 8, 16] if full else [4, 8],
                "slices": [1, 2, 4, 8, 64] if full else [1, 64],
                "slice_block": [128, 256, 512, 1024] if full else [256, 512],
                "slice_warps": [2, 4, 8] if full else [4, 8]}

    takes_shared = False  # does the op's call take this rank's shared partial?

    def resolved(self, ops):
        o = ops[0]
        return {"block": int(o.block), "num_warps": int(o.num_warps), "slices": int(o.slices),
                "slice_block": int(o.slice_block), "slice_warps": int(o.slice_warps)}

    def step_for(self, world, ops, cfg, M, seed):
        ins = _inputs(world, cfg, M, seed)
        nw = [B.rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=8, copies=1, dtype=cfg.dtype,
                             device=world.device, seed=seed + r)[0] for r in range(world.world_size)]
        keys = ("shared", "expert_out", "expert_weights", "expanded_idx")[0 if self.takes_shared else 1:]

        def step(i):
            return world.run(lambda r: ops[r](norm_weight=nw[r], **{k: ins[r][k] for k in keys}))
        return step


class LaneSpec(_FusedSpec):
    name = "LaneAllReduce"
    takes_shared = True

    def ms(self, full):
        return [16, 64, 256, 1024] if full else [16, 64]

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        from .finalize import LaneAllReduce

        return world.build(lambda r: LaneAllReduce(world.group(r), latent=cfg.latent, hidden=cfg.hidden,
                                                   max_tokens=max_tokens, top_k=cfg.top_k, eps=cfg.eps, dtype=cfg.dtype,
                                                   timeout_s=timeout_s, tactics=tactic or None))



class FinalizeSpec(_FusedSpec):
    name = "FinalizeAllReduceRMSNorm"

    def ms(self, full):
        return [1, 16, 256] if full else [1, 16]

    def shape(self, cfg):
        return T.shape_string(width=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        from .finalize import FinalizeAllReduceRMSNorm

        return world.build(lambda r: FinalizeAllReduceRMSNorm(world.group(r), width=cfg.latent,
                                                              max_tokens=max_tokens,
                                                              top_k=cfg.top_k, eps=cfg.eps, dtype=cfg.dtype,
                                                              timeout_s=timeout_s, tactics=tactic or None))



class _Project:
    """``project`` with a fixed tactic (the per-rank "op" of ProjectSpec)."""

    def __init__(self, tactic: dict, n: int):
        self.tactic, self.n = tactic, n

    def resolved(self) -> dict:
        from .projection import default_tactics

        return {**default_tactics(self.n, interpret=False), **self.tactic}  # project()'s CUDA defaults, filled in

    def __call__(self, *args, **kwargs):
        from .projection import project

        return project(*args, tactics=self.tactic, **kwargs)


class ProjectSpec(Spec):
    """``k3tail.project`` on this rank's shard ``[H/W, L]`` (no communication; every virtual
    rank runs it on its own stream, as in the tiers).  ``triton_max_m`` is measured as a
    crossover: the largest M up to which the Triton skinny GEMM beats the cuBLAS path."""

    name = "project"

    def ms(self, full):
        return [1, 4, 16] if full else [1, 16]

    def space(self, full, W, cfg):
        # triton_max_m 0: every M takes the cuBLAS path (measured against the Triton one)
        if full:
            return {"block_n": [16, 32, 64, 128], "block_k": [64, 128, 256, 512], "num_warps": [2, 4, 8],
                    "triton_max_m": [0, 1, 2, 4, 8, 16]}
        return {"block_n": [16, 32, 64], "block_k": [128, 256, 512], "num_warps": [4, 8], "triton_max_m": [0, 1, 16]}

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        t = dict(tactic or {})
        # project() validates its tactics at call time: reject bad ones here, before timing
        from .projection import _TACTIC_KEYS

        unknown = set(t) - _TACTIC_KEYS
        if unknown:
            raise ValueError(f"tactics has unknown keys {sorted(unknown)}")
        for k in ("block_n", "block_k"):
            if k in t and (t[k] < 16 or t[k] & (t[k] - 1)):
                raise ValueError(f"tactics[{k!r}] must be a power of two >= 16, got {t[k]}")
        return [_Project(t, cfg.hidden // world.world_size) for _ in range(world.world_size)]

    def resolved(self, ops):
        return ops[0].resolved()

    def step_for(self, world, ops, cfg, M, seed):
        W = world.world_size
        dev = world.device
        normed = [torch.randn(M, cfg.latent, device=dev, generator=B._gen(dev, seed + r)).to(cfg.dtype)
                  for r in range(W)]
        ins = _inputs(world, cfg, M, seed, deferred=False)
        ws = _weights(world, cfg, 8, seed)
        S = cfg.hidden // W
        cols = [slice(r * S, (r + 1) * S) for r in range(W)]
        shsum = [ins[r]["shared"][:, cols[r]].float().contiguous() for r in range(W)]
        pre = [ins[r]["prefix_hidden"][:, cols[r]].contiguous() for r in range(W)]

        def step(i):
            return world.run(lambda r: ops[r](normed[r], ws[r][1][i % 8], prefix=pre[r], shared_sum=shsum[r],
                                              out_dtype=cfg.dtype))
        return step


SPECS: Dict[str, Spec] = {s.name: s for s in (LatentTailSpec(), LaneSpec(), ProjectSpec(), FinalizeSpec())}


# ==================================================================== the sweep
class Budget:
    def __init__(self, seconds: Optional[float]):
        self.t0 = time.perf_counter()
        self.end = None if not seconds else self.t0 + seconds

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def evaluate(spec: Spec, world, cfg, tactic: dict, ms: Sequence[int], *, tag: str, timeout_s: float,
             budget_s: float, seed: int) -> Dict[str, Any]:
    """Build the op with ``tactic`` on every rank and time it at each M.  Returns
    ``{"score": sum of medians (inf on failure), "us": {M: median}, "resolved": tactic, "error": str|None}``."""
    try:
        ops = spec.build(world, cfg, tactic, tag, timeout_s, max(ms))
    except (ValueError, TypeError) as e:
        return {"score": math.inf, "us": {}, "resolved": dict(tactic), "error": f"rejected: {e}"}
    except Exception as e:  # noqa: BLE001
        return {"score": math.inf, "us": {}, "resolved": dict(tactic), "error": f"{type(e).__name__}: {e}"}
    resolved = spec.resolved(ops)
    us: Dict[int, float] = {}
    try:
        for M in ms:
            step = spec.step_for(world, ops, cfg, M, seed)
            res = B.time_graph(step, budget_s=budget_s, min_replays=20, max_replays=300)
            us[M] = res["median_us"]
            del step
        for op in ops:
            chk = getattr(op, "check", None)
            if callable(chk):
                chk()
    except Exception as e:  # noqa: BLE001 - a failing candidate is skipped, not fatal
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"score": math.inf, "us": us, "resolved": resolved, "error": f"{type(e).__name__}: {e}"}
    return {"score": sum(us.values()), "us": us, "resolved": resolved, "error": None}


def _fmt_us(us: Dict[int, float]) -> str:
    return " ".join(f"M={m}:{v:.1f}" for m, v in us.items())


def sweep_kernel(spec: Spec, world, cfg, *, full: bool, timeout_s: float, budget_s: float, seed: int,
                 deadline: Budget, say: Callable[[str], None]) -> Optional[Dict[str, Any]]:
    """Coordinate descent over ``spec.space``; returns the best tactic with its timings."""
    W = world.world_size
    ms = spec.ms(full)
    head = f"[tune W={W} {spec.name}]"
    n = [0]

    def run(t):
        n[0] += 1
        return evaluate(spec, world, cfg, t, ms, tag=f"{spec.name}.{W}.{n[0]}", timeout_s=timeout_s,
                        budget_s=budget_s, seed=seed)

    trials: List[Dict[str, Any]] = []  # every measured candidate, in order, for the sweep report

    def note(res, changed=None):
        trials.append({"changed": changed, "tactic": res["resolved"], "us": res["us"],
                       "score": res["score"] if not res["error"] else None, "error": res["error"]})

    base = run({})
    note(base)
    if base["error"]:
        say(f"{head} default tactic failed: {base['error']}; kernel not tuned")
        return None
    say(f"{head} default {base['resolved']}: {_fmt_us(base['us'])} us (sum {base['score']:.1f})")
    best = base
    current = dict(base["resolved"])
    tried = {tuple(sorted(current.items()))}
    skipped = 0
    for key, values in spec.space(full, W, cfg).items():
        for v in values:
            cand = {**current, key: v}
            sig = tuple(sorted(cand.items()))
            if sig in tried:
                continue
            if deadline.left() <= 0:
                skipped += 1
                continue
            tried.add(sig)
            res = run(cand)
            note(res, key)
            mark = ""
            if res["error"]:
                mark = f"skipped ({res['error'][:120]})"
            elif res["score"] < best["score"] * 0.99:  # 1% hysteresis: noise must not flip tactics
                best, mark = res, "new best"
            say(f"{head} {key}={v}: " + (f"{_fmt_us(res['us'])} us (sum {res['score']:.1f}) {mark}"
                                         if not res["error"] else mark))
        current = dict(best["resolved"])
    if skipped:
        say(f"{head} time budget exhausted: {skipped} candidates not measured (use --max-seconds 0 for no limit)")
    gain = base["score"] / best["score"] if best["score"] else 1.0
    say(f"{head} best {best['resolved']}: sum {best['score']:.1f} us ({gain:.2f}x vs default)")
    return {"tactic": best["resolved"], "us": best["score"], "per_m_us": best["us"], "default": base["resolved"],
            "default_us": base["score"], "candidates": n[0], "skipped": skipped, "ms": list(ms), "trials": trials}


# ==================================================================== crossovers
def prefix_threshold(wins: Dict[int, bool], capacity: int) -> int:
    """Largest measured M such that the tier won at every measured M' <= M (never above
    ``capacity``); 0 if it lost at the smallest M (or nothing was measured).  An M that was not
    measured (both tiers failed there, or the grid stopped) extends nothing: a tier that won up to
    64 and was not measured above gets 64, not its capacity."""
    last = 0
    for m in sorted(wins):
        if not wins[m]:
            return last
        last = m
    return min(last, capacity)


SLOW_REPLAY_US = 1e6  # a point whose p99 replay took >= 1 s hid a timed-out wait: a failure


def crossover_thresholds(points: List[Dict[str, Any]], caps_alloc: Dict[str, Any]) -> Dict[str, Any]:
    """Thresholds from graph-phase tier timings (``bench_world`` points)."""
    t = {(p["tier"], p["M"]): p["median_us"] for p in points if p["phase"] == "graph" and p.get("median_us")
         and (p.get("p99_us") or 0) < SLOW_REPLAY_US}
    out: Dict[str, Any] = {}
    ms = sorted({m for _, m in t})
    tf_cap = int(caps_alloc.get("tail_fusion_max_tokens") or 0)
    if tf_cap:
        alt = "FUSED_LANE_AR" if caps_alloc.get("fused_ar") else "SEPARATE_REDUCE"
        # an M where the tier failed (timed out, raised) while the alternative ran counts as a loss
        wins = {m: ("TAIL_FUSION", m) in t and t[("TAIL_FUSION", m)] <= t[(alt, m)] for m in ms
                if m <= tf_cap and (alt, m) in t}
        if wins:
            out["tail_fusion_max_tokens"] = prefix_threshold(wins, tf_cap)
    lane_cap = int(caps_alloc.get("lane_max_tokens") or 0)
    if caps_alloc.get("fused_ar") and lane_cap:
        wins = {m: ("FUSED_LANE_AR", m) in t and t[("FUSED_LANE_AR", m)] <= t[("SEPARATE_REDUCE", m)]
                for m in ms if m <= lane_cap and ("SEPARATE_REDUCE", m) in t}
        if wins:
            out["lane_max_tokens"] = prefix_threshold(wins, lane_cap)
    return out


def tune_crossovers(world, cfg_kwargs: Dict[str, Any], ms: Sequence[int], *, timeout_s: float, budget_s: float,
                    seed: int, say: Callable[[str], None],
                    tactics_table: Optional[T.TacticTable] = None) -> Optional[Dict[str, Any]]:
    """Time every possible tier at each M (graph phase) and derive the selector thresholds.
    ``tactics_table``: the kernels' tactics to time the tiers with (the ones just tuned); its
    crossover entries are ignored, so that earlier thresholds cannot hide a tier."""
    from .module import TailConfig

    W = world.world_size
    cfg = TailConfig(**{**cfg_kwargs, "max_tokens": max(ms)})
    kernel_tactics = T.TacticTable(entries={k: v for k, v in (tactics_table.entries if tactics_table else {}).items()
                                            if k.kernel != T.CROSSOVER_KERNEL})
    rig = B._Rig(W, cfg, multiproc=False, prefix=f"k3tail.tune.crossover.{W}", world=world,
                 module_kwargs={"lane_max_tokens": max(ms), "tactics_table": kernel_tactics,
                                "timeout_s": timeout_s})
    caps_alloc = dict(B._caps_dict(getattr(rig.mods[0], "_alloc_caps", rig.caps)))
    say(f"[tune W={W} crossovers] caps {caps_alloc}; timing tiers at M={list(ms)}")
    res = B.bench_world(rig, ms, tiers=None, phases=["graph"], deferred=True, budget_s=budget_s, max_calls=8,
                        seed=seed, baselines=False, progress=lambda s: say(f"[tune W={W} crossovers]{s[1:]}"))
    th = crossover_thresholds(res["points"], caps_alloc)
    say(f"[tune W={W} crossovers] thresholds {th}")
    rig.mods = None
    return {"thresholds": th, "points": [{k: p[k] for k in ("tier", "M", "median_us", "p99_us")}
                                         for p in res["points"]], "caps": caps_alloc}


# ==================================================================== CLI
def add_arguments(parser):
    parser.description = (parser.description or "") + ". GPU only (loopback on one GPU)."
    B.add_common_arguments(parser)
    parser.add_argument("--kernels", type=lambda s: [k.strip() for k in s.split(",") if k.strip()],
                        default=list(DEFAULT_KERNELS),
                        help=f"kernels to sweep, comma-separated (default {','.join(DEFAULT_KERNELS)}; "
                             f"known: {','.join(SPECS)}); 'none' for crossovers only")
    parser.add_argument("--full", action="store_true", help="wider sweeps and M sets (much longer)")
    parser.add_argument("--no-crossovers", action="store_true", help="tactics only")
    parser.add_argument("--crossover-m", type=B.parse_ints, default=None,
                        help="M grid for the tier crossovers (default 1,2,4,8,16,32,64,128,256; --full adds 512,1024)")
    parser.add_argument("--out", default=None,
                        help=f"table to write/merge into (default: the shipped {T.SHIPPED_TABLE})")
    parser.add_argument("--fresh", action="store_true", help="do not merge into the existing --out table")
    parser.add_argument("--budget-s", type=float, default=0.05, help="seconds of replays per timing (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="peer wait timeout of the ops built for tuning (default %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="overall time budget (default 200, or none with --full; 0 = none)")
    parser.add_argument("--out-dir", default="bench/results",
                        help="where the sweep report (every candidate's timings, the crossover points) goes "
                             "as tune_<device>.json + .png (default %(default)s); the table goes to --out")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def main(args) -> int:
    if not torch.cuda.is_available():
        print(B.GPU_ONLY_MSG.format(cmd="tune"), file=sys.stderr)
        return 2
    from .testing import no_multicast
    from .workspace import LoopbackWorld

    no_multicast()
    kernels = [] if args.kernels in (["none"], []) else list(args.kernels)
    bad = [k for k in kernels if k not in SPECS]
    if bad:
        print(f"k3tail tune: unknown kernel(s) {bad}; known: {list(SPECS)}", file=sys.stderr)
        return 2
    max_s = args.max_seconds if args.max_seconds is not None else (None if args.full else 200.0)
    budget = Budget(max_s or None)
    say = lambda s: print(s, flush=True)  # noqa: E731
    out = T.SHIPPED_TABLE if args.out is None else args.out
    try:
        table = T.TacticTable() if args.fresh else T.load_table(out)
    except FileNotFoundError:
        table = T.TacticTable()
    fields = T.device_fields()
    meta = B.results_meta(loopback=True)
    cfg_kwargs = dict(hidden=args.hidden, latent=args.latent, top_k=args.top_k, dtype=B.DTYPES[args.dtype])
    from .module import TailConfig

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
              "shape": spec_shape(cfg), "crossover_m": None if args.no_crossovers else xms, "worlds": [],
              "figures": []}
    name = f"tune_{B._slug(meta['device'])}"
    for wi, W in enumerate(args.world_sizes):
        if W < 2 or cfg.hidden % (8 * W):
            say(f"[tune W={W}] skipped: W must be >= 2 and hidden a multiple of 8*W")
            continue
        world = LoopbackWorld(W)
        wrep: Dict[str, Any] = {"world_size": W, "kernels": {}, "crossovers": None}
        report["worlds"].append(wrep)
        # share the time left evenly among the remaining W; 60% of a W's share for the sweeps
        share = budget.left() / (len(args.world_sizes) - wi)
        sweep_deadline = Budget(None if math.isinf(share) else max(1.0, 0.6 * share))
        for ki, kname in enumerate(kernels):
            spec = SPECS[kname]
            # each remaining kernel gets an equal share of what is left of this W's sweep time
            kdl = Budget(None if sweep_deadline.end is None else max(0.5, sweep_deadline.left() / (len(kernels) - ki)))
            r = sweep_kernel(spec, world, cfg, full=args.full, timeout_s=args.timeout_s, budget_s=args.budget_s,
                             seed=args.seed, deadline=kdl, say=say)
            if r is not None:
                wrep["kernels"][spec.name] = {k: r[k] for k in ("tactic", "us", "default", "default_us", "skipped")}
                wrep["kernels"][spec.name]["trials"] = r.pop("trials")
                key = T.make_key(spec.name, world_size=W, shape=spec.shape(cfg), **fields)
                table.put(key, r.pop("tactic"), us=r.pop("us"), info={**info_common, **r})
                n_written += 1
        if not args.no_crossovers:
            try:
                x = tune_crossovers(world, cfg_kwargs, xms, timeout_s=args.timeout_s, budget_s=args.budget_s,
                                    seed=args.seed, say=say, tactics_table=table)
            except Exception as e:  # noqa: BLE001
                say(f"[tune W={W} crossovers] FAILED: {type(e).__name__}: {e}")
                x = None
            wrep["crossovers"] = x
            if x is not None and x["thresholds"]:
                key = T.make_key(T.CROSSOVER_KERNEL, world_size=W, shape=spec_shape(cfg), **fields)
                table.put(key, x["thresholds"], info={**info_common, "points": x["points"], "caps": x["caps"],
                                                      "phase": "graph"})
                n_written += 1
        del world
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        T.save_table(table, out)  # after every W: an interrupted run keeps what it measured
        B.write_results(name, {**report, "seconds": budget.elapsed()}, args.out_dir)
        say(f"[tune W={W}] done at {budget.elapsed():.0f} s; table saved to {out}")
    table.meta = {**table.meta, "written_by": "k3tail tune", "date": meta["date"], "commit": meta["commit"]}
    T.save_table(table, out)
    if not args.no_plot:
        png = tune_plot(report, Path(args.out_dir) / f"{name}.png",
                        title=f"k3tail tune: {meta['device']}, {report['shape']}, loopback")
        if png:
            report["figures"].append(png.name)
            say(f"wrote {png}")
    path = B.write_results(name, {**report, "seconds": budget.elapsed()}, args.out_dir)
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
    plt = B._pyplot()
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
                            color=B.TIER_COLORS.get(tier))
            for name, m in (x.get("thresholds") or {}).items():
                if m:
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
    return B._save_figure(plt, fig, path, dpi=110)


def spec_shape(cfg) -> str:
    return T.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)
