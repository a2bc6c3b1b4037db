"""``k3tail tune``'s tactics: how each tuned kernel is built, fed and timed (a :class:`Spec` per
kernel of the tactic table, ``SPECS``), and the coordinate descent over a kernel's tactic space
(:func:`sweep_kernel`, one candidate timed by :func:`evaluate`) within a time :class:`Budget`.

The specs: LatentTail (TAIL_FUSION's kernels), LaneAllReduce, project and
FinalizeAllReduceRMSNorm, each with its M set, its tactic space (the keys its op accepts, in the
order the descent visits them) and the table's shape string.  Timing goes through
``k3tail.tools.timing.time_graph``, looked up at call time (the CPU tests replace it there).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from k3tail import tuning as T
from k3tail.tools import timing
from k3tail.tools.bench_rig import generator, rank_inputs, rank_weights


# ------------------------------------------------------------------------------ the specs
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
    return [rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=cfg.hidden // W, copies=copies,
                           dtype=cfg.dtype, device=world.device, seed=seed + 7919 * r) for r in range(W)]


def _inputs(world, cfg, M, seed, deferred=True):
    return [rank_inputs(M=M, hidden=cfg.hidden, latent=cfg.latent, top_k=cfg.top_k, dtype=cfg.dtype,
                          device=world.device, seed=seed + 1000 * M + r, deferred=deferred)
            for r in range(world.world_size)]


class LatentTailSpec(Spec):
    name = "LatentTail"

    def ms(self, full):
        return [1, 2, 4, 8, 16] if full else [1, 16]

    def space(self, full, W, cfg):
        # kernel B: the GEMM family's decode tile and how many programs share the reduction tree's chunks
        # (b_split: a divisor of gemm.tree_chunks(latent)): every tree tactic gives the same bits.  The
        # decode GEMV's tile (b_gemv_rows, b_gemv_warps) and, in the full sweep, the largest M it takes
        # (b_gemv_max_m: which M get the GEMV's bits instead of the tree's) serve batch_invariant=False only
        from k3tail.triton_kernels.gemm import tree_chunks

        tree = tree_chunks(cfg.latent)
        splits = [s for s in (1, 2, 4, 8) if tree % s == 0]
        if full:
            return {"b_block_n": [16, 32, 64], "b_swap_ab": [True, False], "b_tma": [False, True],
                    "b_warps": [2, 4, 8], "b_stages": [4, 6, 8, 12, 16, 24, 32], "b_k_unroll": [1, 2, 4, 7],
                    "b_split": splits, "b_gemv_max_m": [0, 1, 2, 4], "b_gemv_rows": [4, 8, 16],
                    "b_gemv_warps": [4, 8, 16], "a_slices": [1, 2, 4, 7, 14, 28], "a_programs": [0, 4, 8, 16],
                    "a_warps": [4, 8, 16],
                    "c_block": [512, 1024, 2048], "c_programs": [4, 8, 16, 32, 64]}
        return {"b_block_n": [16, 32], "b_tma": [False, True], "b_stages": [6, 8, 12, 16], "b_k_unroll": [1, 4],
                "b_split": splits[-2:], "b_gemv_rows": [4, 8], "b_gemv_warps": [4, 8], "a_slices": [4, 7, 14],
                "a_warps": [4, 8], "c_programs": [8, 16, 32]}

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        from k3tail.ops.tail import LatentTail

        return world.build(lambda r: LatentTail(world.group(r), hidden=cfg.hidden, latent=cfg.latent,
                                                top_k=cfg.top_k, eps=cfg.eps, max_tokens=16, dtype=cfg.dtype,
                                                key=f"k3tail.tools.tune.{tag}", timeout_s=timeout_s,
                                                tactics=tactic or None))

    def resolved(self, ops):
        return dict(ops[0].tactics)

    def step_for(self, world, ops, cfg, M, seed):
        ins = _inputs(world, cfg, M, seed)
        ws = _weights(world, cfg, 8, seed)

        def step(i):
            return world.run(lambda r: ops[r](prefix_hidden=ins[r]["prefix_hidden"], shared=ins[r]["shared"],
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
        nw = [rank_weights(hidden=cfg.hidden, latent=cfg.latent, up_rows=8, copies=1, dtype=cfg.dtype,
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
        from k3tail.ops.finalize_ar_norm import LaneAllReduce

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
        from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

        return world.build(lambda r: FinalizeAllReduceRMSNorm(world.group(r), width=cfg.latent,
                                                              max_tokens=max_tokens,
                                                              top_k=cfg.top_k, eps=cfg.eps, dtype=cfg.dtype,
                                                              timeout_s=timeout_s, tactics=tactic or None))


class _Project:
    """``project`` with a fixed tactic (the per-rank "op" of ProjectSpec)."""

    def __init__(self, tactic: dict):
        from k3tail.ops.projection import Projector, fast_chain_above

        # the module's fast-mode policy (the default config): the chain above FAST_CHAIN_ABOVE, if set
        self.tactic, self.proj = tactic, Projector(tactic, chain_above=fast_chain_above(False))  # ValueError: bad

    def resolved(self) -> dict:
        from k3tail.ops.projection import BUCKETS, CHAIN_KEY

        out = {key: dict(self.proj.tree_tactic(top if top is not None else 1 << 30)) for key, top in BUCKETS}
        if self.proj.chain_above is not None:
            out[CHAIN_KEY] = dict(self.proj.tactic_for(self.proj.chain_above + 1))
        return out

    def __call__(self, *args, **kwargs):
        return self.proj(*args, **kwargs)


def _bucket_candidates(full: bool) -> Dict[str, list]:
    """The GEMM family's candidates (``triton_kernels.gemm.CANDIDATES``) for each of ``project``'s M
    buckets: those timed at an M of the bucket.  bench/bench_gemm.py checks on the device that they give
    the same bits (on the H200 every candidate did): a table must only mix candidates of one bit-class.
    Where the fast mode runs the chain (``projection.FAST_CHAIN_ABOVE`` set), also the chain's tile
    (``"chain"``: ``gemm.CHAIN_CANDIDATES``, the chain's own bit-class)."""
    from k3tail.ops.projection import BUCKETS, CHAIN_KEY, fast_chain_above
    from k3tail.triton_kernels import gemm as G

    ws = G.warp_spec_supported()

    def pick(table: dict, keep) -> list:  # the candidates of ``table`` that ``keep`` (timed M), runnable here
        names = [n for n, (t, ms) in table.items() if keep(ms) and (ws or not t["warp_spec"])]
        return [dict(table[n][0]) for n in (names if full else names[:4])]

    out: Dict[str, list] = {}
    lo = 0
    for key, top in BUCKETS:
        hi = top if top is not None else 1 << 30
        out[key] = pick(G.CANDIDATES, lambda ms, lo=lo, hi=hi: any(lo < m <= hi for m in ms))
        lo = hi
    if fast_chain_above(False) is not None:
        out[CHAIN_KEY] = pick(G.CHAIN_CANDIDATES, lambda ms: True)
    return out


class ProjectSpec(Spec):
    """``k3tail.project`` on this rank's shard ``[H/W, L]`` (no communication; every virtual rank runs it
    on its own stream, as in the tiers): one GEMM tactic per M bucket (``m16``, ``m256``, ``large``), and
    the chain's (``chain``) where the fast mode runs it (``projection.FAST_CHAIN_ABOVE`` below 1024, the
    largest M timed)."""

    name = "project"

    def ms(self, full):
        return [1, 16, 256, 1024] if full else [1, 256, 1024]

    def space(self, full, W, cfg):
        return _bucket_candidates(full)

    def build(self, world, cfg, tactic, tag, timeout_s, max_tokens):
        return [_Project(dict(tactic or {})) for _ in range(world.world_size)]

    def resolved(self, ops):
        return ops[0].resolved()

    def step_for(self, world, ops, cfg, M, seed):
        W = world.world_size
        dev = world.device
        normed = [torch.randn(M, cfg.latent, device=dev, generator=generator(dev, seed + r)).to(cfg.dtype)
                  for r in range(W)]
        ins = _inputs(world, cfg, M, seed, deferred=False)
        ws = _weights(world, cfg, 8, seed)
        S = cfg.hidden // W
        cols = [slice(r * S, (r + 1) * S) for r in range(W)]
        shsum = [ins[r]["shared"][:, cols[r]].float().contiguous() for r in range(W)]
        pre = [ins[r]["prefix_hidden"][:, cols[r]].contiguous() for r in range(W)]

        def step(i):
            return world.run(lambda r: ops[r](normed[r], ws[r][1][i % 8], prefix_hidden=pre[r], shared_sum=shsum[r],
                                              out_dtype=cfg.dtype))
        return step


SPECS: Dict[str, Spec] = {s.name: s for s in (LatentTailSpec(), LaneSpec(), ProjectSpec(), FinalizeSpec())}


def spec_shape(cfg) -> str:
    return T.shape_string(H=cfg.hidden, L=cfg.latent, K=cfg.top_k, dtype=cfg.dtype)


# ------------------------------------------------------------------------------ the sweep
class Budget:
    """A time budget from now: ``left()`` seconds (inf without one), ``elapsed()`` seconds."""

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
            res = timing.time_graph(step, budget_s=budget_s, min_replays=20, max_replays=300)
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
