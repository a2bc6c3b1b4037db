"""Issue 28's diagnostic: which op of which tier returns wrong numbers in GPU loopback, at which M.

Two levels, each reported without raising (one line per case, ``BAD`` where anything is off):

1. the peer collectives alone (``context.coll`` of rank r's module): the fp32 all-reduce of the
   latent (fp64 rank-order sum, rounded once) and of the hidden width, and the 16-bit column
   gather, on fresh random inputs, each compared bit for bit with its torch twin;
2. every possible tier of ``K3MoETail`` at each M, against the fp64 reference (share within
   1 ulp + tie slack), against SEPARATE_REDUCE (the tier bound) and across ranks.

    python bench/diag_loopback_tiers.py --world-sizes 3 6 --ms 64 65 200
    K3TAIL_DISABLE_PDL=1 python bench/diag_loopback_tiers.py ...     (rule PDL in or out)

A diagnostic, not a test: the GPU tests in ``tests/test_pairing.py`` assert the same things.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.*
from k3tail.testing import no_multicast  # noqa: E402

no_multicast()  # before any GPU work (DESIGN §8)
import torch  # noqa: E402

import k3tail  # noqa: E402
from k3tail import reference as R  # noqa: E402
from k3tail import testing as T  # noqa: E402
from k3tail.ops.prefill import shard_bounds  # noqa: E402
from k3tail.tiers import Tier  # noqa: E402

K3 = dict(hidden=7168, latent=3584, top_k=16)


def rows_of(bad: torch.Tensor) -> str:
    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()
    cols = bad.reshape(bad.shape[0], -1).any(0).nonzero().flatten()
    return (f"{int(bad.sum())} wrong, rows {rows[:24]}{'...' if len(rows) > 24 else ''} ({len(rows)}), "
            f"cols {int(cols.min())}..{int(cols.max())} ({cols.numel()})")


def collectives(world, mods, M, seed) -> bool:
    W, dev = world.world_size, world.device
    g = torch.Generator().manual_seed(seed)
    ok = True
    for width, fp64 in ((K3["latent"], True), (K3["hidden"], False)):
        xs = [torch.randn(M, width, generator=g) for _ in range(W)]
        ref = torch.zeros(M, width, dtype=torch.float64)
        for x in xs:
            ref += x.double()
        ref = ref.float()
        xd = [x.to(dev) for x in xs]
        outs = world.run(lambda r: mods[r].context.coll.all_reduce_sum(xd[r], fp64=fp64))
        torch.cuda.synchronize()
        for m in mods:
            m.check()
        for r in range(W):
            bad = outs[r].cpu().view(torch.int32) != ref.view(torch.int32)
            if bad.any():
                ok = False
                print(f"    BAD all_reduce_sum width {width} M={M} rank {r}: {rows_of(bad)}", flush=True)
    bh = shard_bounds(K3["hidden"], W)
    full = (torch.randn(M, K3["hidden"], generator=g)).to(torch.bfloat16)
    ys = [full[:, bh[r]:bh[r + 1]].contiguous().to(dev) for r in range(W)]
    outs = world.run(lambda r: mods[r].context.coll.all_gather_cols(ys[r], bh))
    torch.cuda.synchronize()
    for r in range(W):
        bad = outs[r].cpu().view(torch.int16) != full.view(torch.int16)
        if bad.any():
            ok = False
            print(f"    BAD all_gather_cols M={M} rank {r}: {rows_of(bad)}", flush=True)
    print(f"  collectives W={W} M={M}: {'ok' if ok else 'BAD'}", flush=True)
    return ok


def tiers(world, mods, M, seed) -> bool:
    from tests.test_pairing import _inputs, _ref_bounds  # the GPU test's own inputs and bounds
    W, dev = world.world_size, world.device
    ins = [_inputs(K3, M, W, r, seed=seed, device=dev) for r in range(W)]
    outs = {}
    ok = True
    for tier in Tier:
        if mods[0].why_not(tier, M) is not None:
            continue
        try:
            res = world.run(lambda r, tier=tier: mods[r](tier=tier, **ins[r]))
            torch.cuda.synchronize()
            for m in mods:
                m.check()
        except k3tail.K3TailError as e:
            print(f"    BAD {tier.name} M={M}: {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        outs[tier.name] = ([y.cpu() for y in res], mods[0].plan_for(M, False, tier))
    kw, floor = _ref_bounds(K3, M, W, seed=seed)
    sep = outs.get("SEPARATE_REDUCE", ([None], None))[0][0]
    for name, (ys, plan) in outs.items():
        line = f"    {name:16s} {str(plan):40s}"
        for r in range(1, W):
            ne = ys[r].view(torch.int16) != ys[0].view(torch.int16)
            if ne.any():
                ok = False
                line += f" ranks 0/{r} differ: {rows_of(ne)};"
        try:
            st = T.check_tail(ys[0], what=name, **kw)
            line += f" fp64 max {st['max_ulp']:.1f} ulp rel bias {st['rel_bias']:+.2e};"
        except AssertionError as e:
            ok = False
            r64 = R.tail(latent_dtype=ys[0].dtype, **kw)
            bad = (R.f64(ys[0]) - r64).abs() > 4 * R.ulp(r64, ys[0].dtype) + floor
            line += f" FP64 FAILS ({rows_of(bad)}): {str(e)[:160]};"
        if sep is not None and name != "SEPARATE_REDUCE":
            ag = R.tier_agreement(ys[0], sep, floor)
            line += f" vs SEPARATE {ag['max_ulp']:.1f} ulp beyond {ag['beyond']}"
            ok = ok and ag["beyond"] == 0
        print(line, flush=True)
    print(f"  tiers W={W} M={M}: {'ok' if ok else 'BAD'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[3])
    ap.add_argument("--ms", type=int, nargs="+", default=[64, 65, 200])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-tiers", action="store_true")
    ap.add_argument("--skip-collectives", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_loopback_tiers: needs a CUDA GPU")
    print("env:", {k: os.environ.get(k) for k in ("K3TAIL_DISABLE_PDL", "K3TAIL_TRITON_DISPATCH",
                                                   "K3TAIL_LOOPBACK_SPIN_SHARE")}, flush=True)
    all_ok = True
    for W in args.world_sizes:
        t0 = time.monotonic()
        world = k3tail.LoopbackWorld(W)
        cfg = k3tail.TailConfig(max_tokens=args.max_tokens)
        mods = world.build(lambda r: k3tail.K3MoETail(cfg, world.group(r), prefix=f"diag.w{W}.layers.0",
                                                      timeout_s=20.0))
        print(f"W={W}: built in {time.monotonic() - t0:.1f} s", flush=True)
        for rep in range(args.repeat):
            for M in args.ms:
                if not args.skip_collectives:
                    all_ok &= collectives(world, mods, M, seed=1000 * rep + M)
                if not args.skip_tiers:
                    all_ok &= tiers(world, mods, M, seed=M + 7 * rep)
        print(f"W={W}: {time.monotonic() - t0:.1f} s", flush=True)

    print("ALL OK" if all_ok else "SOME BAD", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
