"""``k3tail demo``: the whole K3 MoE tail on CPU ranks (default) or in loopback on one GPU.

For each token count M, every rank builds the same inputs' own part (its routed partial as the
deferred finalize triple, its shared-expert partial, its rows of W_up), every tier possible
here runs on them, and the demo prints the tier the selector takes (eager and inside a CUDA
graph), each tier's error against the contract-faithful fp64 reference (max ulp, the fraction
within 1 ulp allowing for latent elements on a rounding tie, signed bias) and its distance to
SEPARATE_REDUCE, the portable reference path.

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

import sys
import time

import torch

from k3tail import reference as ref
from k3tail.testing import tail_inputs

K3 = dict(hidden=7168, latent=3584, top_k=16)
SMALL = dict(hidden=512, latent=256, top_k=4)
CPU_TACTICS = {}  # (the interpreter runs the projection GEMM with large tiles)


def add_arguments(parser):
    parser.add_argument("--world-size", "-W", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--tokens", "-M", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="token counts to run (default 1 4 16 64)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: one process per rank (interpreter); cuda: loopback on one GPU")
    parser.add_argument("--processes", action="store_true",
                        help="with --device cuda: one real process per rank on the local GPU(s) instead of "
                             "loopback (one GPU: W processes share it, gloo + overlapping symmetric memory; "
                             "W GPUs: one process per GPU, NCCL)")
    parser.add_argument("--small", action="store_true", help="small shape (H 512, L 256, top-k 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a short run for CI and smoke checks: small shape, W=2, M = 1, 16, 80 "
                             "(overrides --small, --world-size and --tokens; the full run is the default)")


def _inputs(shape, M, W, rank, seed, device):
    prefix, gamma, up, shared, rt = tail_inputs(M=M, W=W, rank=rank, form="triple", seed=seed,
                                                device=device, **shape)
    rows = shape["hidden"] // W
    return dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma,
                up_weight=up[rank * rows:(rank + 1) * rows].contiguous(), **rt)


def _run_tiers(mod, call):
    """``call(tier) -> out`` for every tier possible at each M; returns {tier name: (out, seconds)}."""
    from k3tail.tiers import Tier

    res = {}
    for tier in Tier:
        if mod.why_not(tier, call.M) is None:
            t0 = time.perf_counter()
            out = call(tier)
            res[tier.name] = (out, time.perf_counter() - t0)
    return res


def _rank_main(rank, W, shape, tokens, seed, device="cpu"):
    """Body of one rank process (CPU: interpreter; cuda: this process's GPU): every possible
    tier at every M, plus the selector's choices."""
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail

    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    cfg = TailConfig(max_tokens=max(tokens), **shape)
    if device == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        mod = K3MoETail(cfg, prefix="demo.layers.0", device=dev, timeout_s=60.0)
    else:
        dev = torch.device("cpu")
        mod = K3MoETail(cfg, prefix="demo.layers.0", tactics=CPU_TACTICS)
    fused = FinalizeAllReduceRMSNorm(width=shape["latent"], max_tokens=max(tokens), top_k=shape["top_k"], eps=1e-5,
                                     **(dict(device=dev) if device == "cuda" else {}))
    out = {}
    for M in tokens:
        ins = _inputs(shape, M, W, rank, seed, dev)

        def call(tier, ins=ins):
            return mod(**ins, tier=tier).cpu()  # .cpu(): the wall time includes the device work

        call.M = M
        results = {k: (v[0], v[1]) for k, v in _run_tiers(mod, call).items()}
        t0 = time.perf_counter()
        results[FUSED_OP] = (_fused_op(fused, ins).cpu(), time.perf_counter() - t0)
        out[M] = (results, mod.tier_for(M, False).name, mod.tier_for(M, True).name)
    return out


FUSED_OP = "fused op*"  # the standalone FinalizeAllReduceRMSNorm (DESIGN §3.3): normed latent only


def _fused_op(op, ins):
    return op(norm_weight=ins["norm_weight"], expert_out=ins["expert_out"], expert_weights=ins["expert_weights"],
              expanded_idx=ins["expanded_idx"])


def _cuda_main(W, shape, tokens, seed):
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail
    from k3tail.runtime.loopback import LoopbackWorld

    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    world = LoopbackWorld(W)
    mods = world.build(lambda r: K3MoETail(TailConfig(max_tokens=max(tokens), **shape), world.group(r),
                                           prefix="demo.layers.0"))
    fused = world.build(lambda r: FinalizeAllReduceRMSNorm(world.group(r), width=shape["latent"],
                                                           max_tokens=max(tokens), top_k=shape["top_k"], eps=1e-5))
    per_rank = [dict() for _ in range(W)]
    for M in tokens:
        ins = [_inputs(shape, M, W, r, seed, world.device) for r in range(W)]

        def call(tier, ins=ins):
            outs = world.run(lambda r: mods[r](**ins[r], tier=tier))
            torch.cuda.synchronize()
            return [o.cpu() for o in outs]

        call.M = M
        res = _run_tiers(mods[0], call)
        t0 = time.perf_counter()
        normed = world.run(lambda r: _fused_op(fused[r], ins[r]))
        torch.cuda.synchronize()
        res[FUSED_OP] = ([o.cpu() for o in normed], time.perf_counter() - t0)
        for r in range(W):
            per_rank[r][M] = ({k: (v[0][r], v[1]) for k, v in res.items()},
                              mods[0].tier_for(M, False).name, mods[0].tier_for(M, True).name)
    return per_rank


NO_CUDA_MSG = ("k3tail demo --device cuda: needs a CUDA GPU; no CUDA device is visible here. "
               "Run `k3tail demo` (CPU rank processes, kernels in Triton's interpreter) instead.")


def _mode(args) -> str:
    """How the ranks run, for the header line."""
    if args.device == "cpu":
        return "CPU rank processes"
    if not args.processes:
        return "loopback on one GPU"
    from k3tail.runtime.spawn import spawn_plan

    plan = spawn_plan(args.world_size, "cuda")
    if plan.mode == "per_gpu":
        return "rank processes, one per GPU, NCCL"
    return "rank processes sharing cuda:0, gloo + overlapping symmetric memory (time-shared: wall times mean nothing)"


def main(args) -> int:
    if args.quick:
        args.small, args.world_size, args.tokens = True, 2, [1, 16, 80]
    shape = SMALL if args.small else K3
    W, tokens = args.world_size, args.tokens
    processes = getattr(args, "processes", False)
    if processes and args.device != "cuda":
        print("k3tail demo: --processes runs the ranks as processes on the GPU(s); add --device cuda "
              "(CPU ranks always run as processes)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MSG, file=sys.stderr)
        return 2
    args.processes = processes
    print(f"k3tail demo: the MoE tail, W={W} on {args.device} ({_mode(args)}), shape {shape}, M={tokens}")
    t_start = time.perf_counter()
    if args.device == "cpu" or processes:
        from k3tail.runtime.spawn import spawn
        from k3tail.testing import no_multicast

        no_multicast()
        per_rank = spawn(W, _rank_main, shape, tokens, args.seed, args.device, device=args.device, timeout=3600)
    else:
        per_rank = _cuda_main(W, shape, tokens, args.seed)
    print(f"{'M':>4} {'tier':<16}{'taken':<14}{'ranks agree':<12}{'max ulp':>8}{'<=1ulp*':>9}{'bias':>11}"
          f"{'vs SEPARATE':>12}{'wall s':>8}")
    ok = True
    for M in tokens:
        results, eager_tier, graph_tier = per_rank[0][M]
        parts, shared = [], []
        for r in range(W):
            ins = _inputs(shape, M, W, r, args.seed, "cpu")
            parts.append(ref.rank_partial(expert_out=ins["expert_out"], expert_weights=ins["expert_weights"],
                                          expanded_idx=ins["expanded_idx"]))
            shared.append(ins["shared"])
        prefix, gamma, up, _, _ = tail_inputs(M=M, W=W, rank=0, form="triple", seed=args.seed, **shape)
        r64 = ref.tail(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up, eps=1e-5)
        slack, _ = ref.tail_tie_slack(partials=parts, norm_weight=gamma, up_weight=up, eps=1e-5)
        floor = ref.tail_noise_floor(prefix_hidden=prefix, partials=parts, shared=shared, norm_weight=gamma, up_weight=up,
                                     eps=1e-5)
        n64 = ref.finalize_allreduce_rmsnorm(parts, gamma, 1e-5)[0]
        sep = results.get("SEPARATE_REDUCE", (None,))[0]
        for name, (out, wall) in results.items():
            same = all(torch.equal(per_rank[r][M][0][name][0].view(torch.int16), out.view(torch.int16))
                       for r in range(W))
            if name == FUSED_OP:  # the normed latent against its fp64 reference
                st = ref.error_stats(out, n64)
                within = float((ref.ulp_error(out, n64) <= 1.0).double().mean())
                print(f"{M:>4} {name:<16}{'-':<14}{str(same):<12}{st['max_ulp']:>8.2f}{within:>9.5f}"
                      f"{st['bias']:>+11.2e}{'':>12}{wall:>8.2f}")
                ok &= same and within >= 0.999
                continue
            st = ref.error_stats(out, r64)
            within = float(((ref.f64(out) - r64).abs() <= ref.ulp(r64, out.dtype) + slack).double().mean())
            vs_sep = float("nan")
            if sep is not None:  # tiers agree within 2 ulp or the fp32 GEMM floor
                agree = ref.tier_agreement(out, sep, floor)
                vs_sep = agree["max_ulp"]
                ok &= agree["beyond"] == 0
            taken = "+".join(x for x, t in (("eager", eager_tier), ("graph", graph_tier)) if t == name) or "-"
            print(f"{M:>4} {name:<16}{taken:<14}{str(same):<12}{st['max_ulp']:>8.2f}{within:>9.5f}"
                  f"{st['bias']:>+11.2e}{vs_sep:>12.2f}{wall:>8.2f}")
            ok &= same and within >= 0.999
    print("* fraction within 1 ulp of the fp64 reference, allowing latent elements on a rounding tie "
          "(k3tail.reference.tail_tie_slack); 'fused op*' is FinalizeAllReduceRMSNorm on the same routed "
          "partials (its normed latent vs fp64, plain 1 ulp).  'vs SEPARATE' is the largest elementwise "
          "distance in ulp; every element must be within 2 ulp or the projection's fp32 noise floor "
          "(k3tail.reference.tail_noise_floor)")
    print(f"total wall time {time.perf_counter() - t_start:.1f} s; {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1
