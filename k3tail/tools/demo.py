"""``k3tail demo``: the whole K3 MoE tail on CPU ranks (default) or in loopback on one GPU.

For each token count M, every rank builds the same inputs' own part (its routed partial as the
deferred finalize triple, its shared-expert partial, its rows of W_up), every tier possible here
runs on them (forced, ``tier=``), and the demo prints a verdict per tier and overall, with the
statistics it rests on (:mod:`k3tail.tools.demo_report`): bits equal on every rank, the error
against the contract-faithful fp64 reference, the signed bias, the distance to SEPARATE_REDUCE
(the portable reference path), the path each tier ran and which tier the selector takes.

While the ranks work, a progress line at least every few seconds (``HEARTBEAT_S``) says what
runs: rank 0 writes its current step to a file that the parent polls.

CPU: ``--world-size`` processes (gloo + Triton interpreter over shared memory) run the real
multi-rank Lamport protocols; the interpreter is slow, so the non-TAIL tiers use the
projection's fp32-output matmul path there (same rounding contract) instead of its Triton GEMM.
``--device cuda``: the same ranks as virtual ranks in one process on one GPU (loopback).
``--device cuda --processes``: the same ranks as real processes on the local GPU(s), the way a
serving engine runs them (:func:`k3tail.spawn`): one GPU -> all W processes share it (a gloo
group, torch symmetric memory with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``); W or more
GPUs -> one process per GPU with NCCL.  Processes sharing a GPU time-share it, so the wall times
of that mode say nothing about NVLink latency.
"""

from __future__ import annotations

import functools
import os
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from k3tail import reference as ref
from k3tail.testing import tail_inputs
from k3tail.tools import demo_report
from k3tail.tools.options import UsageError, positive_int

K3 = dict(hidden=7168, latent=3584, top_k=16)
SMALL = dict(hidden=512, latent=256, top_k=4)
MAX_TOKENS = 8192  # the largest --tokens value (TailConfig().max_tokens: K3's prefill batch)
QUICK = dict(world_size=2, tokens=[1, 16, 80])  # TAIL_FUSION and the lane at 1 and 16, the sharded path at 80
CPU_TACTICS = {}  # (the interpreter runs the projection GEMM with large tiles)
EPS = 1e-5
HEARTBEAT_S = 3.0  # a progress line at least this often (plus the poll interval) while the ranks work
say = functools.partial(print, flush=True)


def add_arguments(parser):
    parser.add_argument("--world-size", "-W", type=positive_int, default=4, help="ranks (default 4)")
    parser.add_argument("--tokens", "-M", type=positive_int, nargs="+", default=[1, 4, 16, 64],
                        help="token counts to run (default 1 4 16 64)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: one process per rank (interpreter); cuda: loopback on one GPU")
    parser.add_argument("--processes", action="store_true",
                        help="with --device cuda: one real process per rank on the local GPU(s) instead of "
                             "loopback (one GPU: W processes share it, gloo + overlapping symmetric memory; "
                             "W GPUs: one process per GPU, NCCL)")
    parser.add_argument("--small", action="store_true", help="small shape (H 512, L 256, top-k 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast-decode", action="store_true",
                        help="build with the library's default batch_invariant=False (TAIL_FUSION's decode GEMV "
                             "at M <= 4) instead of asking for batch invariance; the invariance check is then "
                             "not run")
    parser.add_argument("--quick", action="store_true",
                        help="a short run for CI and smoke checks: small shape, W=2, M = 1, 16, 80 "
                             "(overrides --small, --world-size and --tokens; the full run is the default)")


# ------------------------------------------------------------------------------ progress
def note_step(path: Optional[str], text: str) -> None:
    """Rank side: record what runs now (rank 0 writes; the parent's :class:`Progress` prints it)."""
    if not path:
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Progress:
    """Parent side: print ``[elapsed] step`` when rank 0's step changes, and at least every
    ``every`` seconds while it does not (``... still running``)."""

    def __init__(self, t0: float, every: float = HEARTBEAT_S, poll: float = 0.25):
        fd, self.path = tempfile.mkstemp(prefix="k3tail-demo-", suffix=".step")
        os.close(fd)
        self.t0, self.every, self.poll = t0, every, poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3tail-demo-progress", daemon=True)

    def step(self, text: str) -> None:
        note_step(self.path, text)

    def _run(self) -> None:
        shown, last = None, time.perf_counter()
        while not self._stop.wait(self.poll):
            try:
                text = Path(self.path).read_text().strip()
            except OSError:
                text = ""
            now = time.perf_counter()
            if text and text != shown:
                say(f"[{now - self.t0:6.1f} s] {text}")
                shown, last = text, now
            elif now - last >= self.every:
                say(f"[{now - self.t0:6.1f} s] ... {shown or 'starting'} (still running)")
                last = now

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for p in (self.path,):
            try:
                os.unlink(p)
            except OSError:
                pass


# ------------------------------------------------------------------------------ the ranks
def _config(shape, tokens, W, invariant=True):
    from k3tail.config import TailConfig

    # every rank holds its rows of W_up (uneven where W does not divide hidden); batch invariance asked
    # unless --fast-decode (the library's default is off: the demo checks the guarantee)
    return TailConfig(max_tokens=max(tokens), batch_invariant=invariant, **shape)


def _inputs(shape, M, W, rank, seed, device, shard):
    from k3tail.ops.prefill import shard_bounds

    prefix, gamma, up, shared, rt = tail_inputs(M=M, W=W, rank=rank, form="triple", seed=seed,
                                                device=device, **shape)
    if shard:
        b = shard_bounds(shape["hidden"], W)
        up = up[b[rank]:b[rank + 1]].contiguous()
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, **rt)


def _alone(ins, pos):
    """Token ``pos`` of a batch's inputs as a batch of one (its expert rows stay where they are)."""
    one = dict(ins)
    for k in ("prefix_hidden", "shared", "expert_weights", "expanded_idx"):
        one[k] = ins[k][pos:pos + 1]
    return one


def _fused_op(op, ins):
    return op(norm_weight=ins["norm_weight"], expert_out=ins["expert_out"], expert_weights=ins["expert_weights"],
              expanded_idx=ins["expanded_idx"])


def _run_all(mod, fused, tokens, make_inputs, call, sync, step: Callable[[str], None]):
    """Every tier possible at each M, then the standalone op: ``{M: {"results": {name: (out, s)},
    "paths": {name: path}, "eager": tier name, "graph": tier name}}`` (``call(tier, ins)``)."""
    from k3tail.tiers import Tier

    out = {}
    for M in tokens:
        ins = make_inputs(M)
        results, paths, skipped = {}, {}, {}
        for tier in Tier:
            why = mod.why_not(tier, M)
            if why is not None:
                skipped[tier.name] = why
                continue
            path = mod.plan_for(M, False, tier).path
            step(f"M={M}: {tier.name} (path {path})")
            t0 = time.perf_counter()
            o = sync(call(tier, ins))
            results[tier.name], paths[tier.name] = (o, time.perf_counter() - t0), path
        step(f"M={M}: {demo_report.STANDALONE} (FinalizeAllReduceRMSNorm)")
        t0 = time.perf_counter()
        o = sync(fused(ins))
        results[demo_report.STANDALONE], paths[demo_report.STANDALONE] = (o, time.perf_counter() - t0), "latent"
        out[M] = {"results": results, "paths": paths, "skipped": skipped, "eager": mod.tier_for(M, False).name,
                  "graph": mod.tier_for(M, True).name}
    # batch invariance on the demo's own tokens (DESIGN §10): the first and last token of the largest
    # batch, each alone (M = 1) in every tier possible there; compared with their rows in the batch
    big = max(tokens)
    ins = make_inputs(big)
    alone = {}
    for pos in sorted({0, big - 1}):
        for tier in Tier:
            if mod.why_not(tier, 1) is None:
                step(f"batch invariance: token {pos} of M={big} alone in {tier.name}")
                alone[(pos, tier.name)] = sync(call(tier, _alone_all(ins, pos)))
    out["alone"] = {"M": big, "rows": alone}
    return out


def _alone_all(ins, pos):
    return [_alone(x, pos) for x in ins] if isinstance(ins, list) else _alone(ins, pos)


def _rank_main(rank, W, shape, tokens, seed, device="cpu", step_path=None, invariant=True):
    """Body of one rank process (CPU: interpreter; cuda: this process's GPU)."""
    from k3tail.module import K3MoETail
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    step = functools.partial(note_step, step_path if rank == 0 else None)
    cfg = _config(shape, tokens, W, invariant)
    step(f"building K3MoETail on {W} ranks (capability vote, workspaces)")
    if device == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        mod = K3MoETail(cfg, prefix="demo.layers.0", device=dev, timeout_s=60.0)
        extra = dict(device=dev)
    else:
        dev = torch.device("cpu")
        mod = K3MoETail(cfg, prefix="demo.layers.0", tactics=CPU_TACTICS)
        extra = {}
    fused = FinalizeAllReduceRMSNorm(width=shape["latent"], max_tokens=max(tokens), top_k=shape["top_k"], eps=EPS,
                                     **extra)
    return _run_all(mod, functools.partial(_fused_op, fused), tokens,
                    lambda M: _inputs(shape, M, W, rank, seed, dev, cfg.shard_up_proj),
                    lambda tier, ins: mod(**ins, tier=tier), lambda o: o.cpu(), step)  # .cpu(): device work timed


def _loopback_main(W, shape, tokens, seed, step, invariant=True):
    """All W ranks as virtual ranks on one GPU: per rank, what :func:`_rank_main` returns."""
    from k3tail.module import K3MoETail
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm
    from k3tail.runtime.loopback import LoopbackWorld

    world = LoopbackWorld(W)
    cfg = _config(shape, tokens, W, invariant)
    step(f"building K3MoETail on {W} loopback ranks")
    mods = world.build(lambda r: K3MoETail(cfg, world.group(r), prefix="demo.layers.0"))
    fused = world.build(lambda r: FinalizeAllReduceRMSNorm(world.group(r), width=shape["latent"],
                                                           max_tokens=max(tokens), top_k=shape["top_k"], eps=EPS))

    def sync(outs):
        torch.cuda.synchronize()
        return [o.cpu() for o in outs]

    res = _run_all(mods[0], lambda ins: world.run(lambda r: _fused_op(fused[r], ins[r])), tokens,
                   lambda M: [_inputs(shape, M, W, r, seed, world.device, cfg.shard_up_proj) for r in range(W)],
                   lambda tier, ins: world.run(lambda r: mods[r](**ins[r], tier=tier)), sync, step)
    alone = res.pop("alone")
    return [{**{M: {**v, "results": {k: (o[r], s) for k, (o, s) in v["results"].items()}} for M, v in res.items()},
             "alone": {"M": alone["M"], "rows": {k: o[r] for k, o in alone["rows"].items()}}} for r in range(W)]


# ------------------------------------------------------------------------------ the verdict
def _rows(per_rank, shape, tokens, W, seed, step):
    rows = []
    shard = _config(shape, tokens, W).shard_up_proj
    for M in tokens:
        step(f"M={M}: the fp64 reference and the statistics")
        got = per_rank[0][M]
        parts, shared, triples = [], [], []
        for r in range(W):
            ins = _inputs(shape, M, W, r, seed, "cpu", shard)
            triples.append((ins["expert_out"], ins["expert_weights"], ins["expanded_idx"]))
            parts.append(ref.rank_partial(expert_out=ins["expert_out"], expert_weights=ins["expert_weights"],
                                          expanded_idx=ins["expanded_idx"]))
            shared.append(ins["shared"])
        prefix, gamma, up, _, _ = tail_inputs(M=M, W=W, rank=0, form="triple", seed=seed, **shape)
        r64 = ref.tail(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up, eps=EPS)
        slack, _ = ref.tail_tie_slack(partials=parts, norm_weight=gamma, up_weight=up, eps=EPS)
        floor = ref.tail_noise_floor(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma,
                                     up_weight=up, eps=EPS)
        n64 = ref.finalize_allreduce_rmsnorm(parts, gamma, EPS)[0]
        latent_floor = demo_report.latent_noise_floor(triples, gamma, EPS)
        sep = got["results"].get("SEPARATE_REDUCE", (None,))[0]
        for name, (out, seconds) in got["results"].items():
            same = all(torch.equal(per_rank[r][M]["results"][name][0].view(torch.int16), out.view(torch.int16))
                       for r in range(W))
            selected = [ph for ph, key in (("decode", "graph"), ("prefill", "eager")) if got[key] == name]
            row = dict(M=M, name=name, path=got["paths"][name], same_bits=same,
                       selected="both" if len(selected) == 2 else selected[0] if selected else "-",
                       seconds=seconds)
            if name == demo_report.STANDALONE:
                rows.append(demo_report.check_latent(out, n64, floor=latent_floor, **row))
            else:
                rows.append(demo_report.check_tail(out, r64, slack=slack, floor=floor,
                                                   sep=None if name == "SEPARATE_REDUCE" else sep, **row))
    return rows


def batch_invariance(per_rank, W, invariant=True) -> tuple:
    """``(ok, line)``: are the probed tokens' rows the same bits alone (M = 1, every tier possible
    there) as in the largest batch (every tier run there), on every rank?  Without ``invariant``
    (--fast-decode) the guarantee was not asked: ``(True, a line that says so)``."""
    from k3tail.tiers import Tier

    if not invariant:
        return True, ("batch invariance: not checked: built with batch_invariant=False (--fast-decode; "
                      "TAIL_FUSION's kernel B takes the decode GEMV at M <= 4, other bits than the tree's)")
    probe = per_rank[0]["alone"]
    big = probe["M"]
    batch = per_rank[0][big]["results"]
    tiers_batch = [n for n in batch if n != demo_report.STANDALONE]
    tiers_alone = [t.name for t in Tier if any(name == t.name for _, name in probe["rows"])]
    bad, n = [], 0
    for r in range(W):
        rows = per_rank[r]["alone"]["rows"]
        res = per_rank[r][big]["results"]
        for pos in sorted({p for p, _ in rows}):
            cands = [(f"alone {t}", rows[(pos, t)][0]) for t in tiers_alone]
            cands += [(f"M={big} {t}", res[t][0][pos]) for t in tiers_batch]
            first_what, first = cands[0]
            for what, row in cands[1:]:
                n += 1
                if not torch.equal(row.view(torch.int16), first.view(torch.int16)):
                    diff = int((row.view(torch.int16) != first.view(torch.int16)).sum())
                    bad.append(f"rank {r} token {pos}: {what} differs from {first_what} in {diff} outputs")
    where = (f"tokens {' and '.join(map(str, sorted({p for p, _ in probe['rows']})))} of the M={big} batch, alone "
             f"(M=1: {', '.join(tiers_alone)}) and in the batch ({', '.join(tiers_batch)})")
    if bad:
        return False, f"batch invariance: NOT OK: {where}: {'; '.join(bad[:4])}"
    return True, f"batch invariance: OK: {where}: the same bits in all {n} comparisons, on every rank"


def _not_run(res, tokens) -> list:
    """The tiers not run, with the module's reason (``why_not``; its first clause), by M where it differs."""
    reasons = {}
    for M in tokens:
        for name, why in res[M]["skipped"].items():
            reasons.setdefault((name, why.split(";")[0]), []).append(M)
    if not reasons:
        return []
    parts = [f"{name}{'' if len(ms) == len(tokens) else ' at M=' + ','.join(map(str, ms))} ({why})"
             for (name, why), ms in reasons.items()]
    return textwrap.wrap("not run here (`k3tail doctor` explains each tier): " + "; ".join(parts), width=118,
                         subsequent_indent="  ")


def _mode(args) -> str:
    """How the ranks run, for the header line."""
    if args.device == "cpu":
        return "CPU rank processes, kernels in Triton's interpreter"
    if not args.processes:
        return "loopback on one GPU"
    from k3tail.runtime.spawn import spawn_plan

    plan = spawn_plan(args.world_size, "cuda")
    if plan.mode == "per_gpu":
        return "rank processes, one per GPU, NCCL"
    return "rank processes sharing cuda:0, gloo + overlapping symmetric memory (time-shared: wall times mean nothing)"


def _time_label(args):
    if args.device == "cpu":
        return "s", ("wall seconds of one call in Triton's interpreter on the CPU (an emulator, thousands of times "
                     "slower than a GPU: says nothing about GPU speed)")
    if args.processes:
        return "ms", "wall milliseconds of one eager call, processes time-sharing the GPU(s): not a latency"
    return "ms", "wall milliseconds of one eager call (all virtual ranks on one GPU, host launch time included)"


NO_CUDA_MSG = ("k3tail demo --device cuda: needs a CUDA GPU; no CUDA device is visible here. "
               "Run `k3tail demo` (CPU rank processes, kernels in Triton's interpreter) instead.")


def main(args) -> int:
    if args.quick:
        args.small, args.world_size, args.tokens = True, QUICK["world_size"], list(QUICK["tokens"])
    shape = SMALL if args.small else K3
    W, tokens = args.world_size, list(dict.fromkeys(args.tokens))
    if max(tokens) > MAX_TOKENS:
        raise UsageError(f"--tokens: at most {MAX_TOKENS} tokens a call (TailConfig's default max_tokens; every "
                         f"rank holds inputs and workspaces for the largest M), got {max(tokens)}")
    if args.processes and args.device != "cuda":
        raise UsageError("--processes runs the ranks as processes on the GPU(s); add --device cuda "
                         "(CPU ranks always run as processes)")
    if args.device == "cuda" and not torch.cuda.is_available():
        say(NO_CUDA_MSG)
        return 2
    t_start = time.perf_counter()
    say(f"k3tail demo: the MoE tail on W={W} ranks ({_mode(args)}), H={shape['hidden']} L={shape['latent']} "
        f"top-k={shape['top_k']} bf16, M={tokens}, seed {args.seed}, "
        f"batch_invariant={not args.fast_decode}{' (asked by the demo to check it)' if not args.fast_decode else ''}")
    with Progress(t_start) as progress:
        if args.device == "cpu" or args.processes:
            from k3tail.runtime.spawn import SpawnError, spawn
            from k3tail.testing import no_multicast

            no_multicast()
            progress.step(f"starting {W} rank processes (each imports torch and k3tail)")
            try:
                per_rank = spawn(W, _rank_main, shape, tokens, args.seed, args.device, progress.path,
                                 not args.fast_decode, device=args.device, timeout=3600)
            except SpawnError as e:
                say(f"k3tail demo: NOT OK: a rank failed: {e}")
                return 1
        else:
            per_rank = _loopback_main(W, shape, tokens, args.seed, progress.step, not args.fast_decode)
        rows = _rows(per_rank, shape, tokens, W, args.seed, progress.step)
    unit, label = _time_label(args)
    say("")
    inv_ok, inv_line = batch_invariance(per_rank, W, not args.fast_decode)
    for line in demo_report.render(rows, world_size=W, time_unit=unit, time_label=label,
                                   not_run=_not_run(per_rank[0], tokens), extra=[inv_line]):
        say(line)
    say(f"total {time.perf_counter() - t_start:.1f} s")
    return 0 if demo_report.all_ok(rows) and inv_ok else 1
