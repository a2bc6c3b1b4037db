"""Issue 28, second look: the standalone one-shot all-reduce in GPU loopback, many calls, and for every
wrong output element *what* it holds instead.

    python bench/diag_allreduce_race.py --world-size 3 --m 200 --calls 40 [--width 3584] [--bf16]

Per call (fresh random inputs per rank, output poisoned with NaN first): the outputs against the
fp64 rank-order sum rounded once.  For a wrong element: is it NaN (never written), the sum without
one source (that source's slot read as the armed -0.0), the previous call's value at that place (a
stale slot), or something else; which launch (row // max_tokens) and which program (item % grid).
After every call, every rank's region is scanned: data or tag slots left un-armed (a write that came
after the consumer re-armed) are counted per stage.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from k3tail.testing import no_multicast

no_multicast()
import torch  # noqa: E402

import k3tail  # noqa: E402
from k3tail.ops.allreduce import Fp32AllReduce, OneShotAllReduce  # noqa: E402
from k3tail.runtime import launch as L  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--m", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--width", type=int, default=3584)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--chunked", action="store_true", help="one world.run (and a sync) per 64-row launch")
    args = ap.parse_args()
    W, M, mt, width = args.world_size, args.m, args.max_tokens, args.width
    world = k3tail.LoopbackWorld(W)
    dev = world.device
    if args.bf16:
        # as the peer collectives' column gather uses it: one call (one launch, its own tag) per mt rows
        ops = world.build(lambda r: OneShotAllReduce(world.group(r), max_tokens=mt, width=width, timeout_s=10.0))
        dt = torch.bfloat16
    else:
        ops = world.build(lambda r: Fp32AllReduce(world.group(r), max_tokens=mt, width=width, timeout_s=10.0))
        dt = torch.float32
    cap, block = ops[0]._cap, ops[0].block
    chunks = -(-width // block)
    print(f"W={W} M={M} width={width} dtype={dt} block={block} chunks={chunks} grid cap {cap} "
          f"pdl={L.pdl_enabled(dev)}", flush=True)
    g = torch.Generator().manual_seed(11)
    prev = None
    bad_calls = 0
    kinds = Counter()
    for call in range(args.calls):
        xs = [torch.randn(M, width, generator=g).to(dt) for _ in range(W)]
        ref64 = torch.zeros(M, width, dtype=torch.float64)
        for x in xs:
            ref64 += x.double()
        ref = ref64.float().to(dt)
        xd = [x.to(dev) for x in xs]
        if args.chunked:
            parts = []
            for r0 in range(0, M, mt):
                parts.append(world.run(lambda r: ops[r](xd[r][r0:r0 + mt].contiguous())))
                torch.cuda.synchronize()
            outs = [torch.cat([p[r] for p in parts]) for r in range(W)]
        elif args.bf16:
            outs = world.run(lambda r: torch.cat([ops[r](xd[r][r0:r0 + mt]) for r0 in range(0, M, mt)]))
        else:
            outs = world.run(lambda r: ops[r](xd[r]))
        torch.cuda.synchronize()
        for op in ops:
            op.check()
        ib = torch.int16 if dt == torch.bfloat16 else torch.int32
        any_bad = False
        for r in range(W):
            o = outs[r].cpu()
            bad = o.view(ib) != ref.view(ib)
            if not bad.any():
                continue
            any_bad = True
            rows, cols = bad.nonzero(as_tuple=True)
            got, exp = o[bad].double(), ref[bad].double()
            what = []
            for i in range(min(len(rows), 4000)):
                t, c = int(rows[i]), int(cols[i])
                gv = float(got[i])
                tags = []
                if gv != gv:
                    tags.append("NaN")
                for s in range(W):
                    wo = (ref64[t, c] - xs[s][t, c].double()).float().to(dt).double()
                    if gv == float(wo):
                        tags.append(f"without{s}")
                if prev is not None and gv == float(prev[t, c]):
                    tags.append("prev_call")
                kinds.update(tags or ["other"])
                if i < 6:
                    item = (t % mt) * chunks + c // block
                    what.append(f"(t{t} c{c} launch {t // mt} item {item} prog {item % cap}: got {gv:.5g} want "
                                f"{float(exp[i]):.5g} {tags or ['other']})")
            launches = sorted(set((rows // mt).tolist()))
            items = sorted(set((((rows % mt) * chunks + cols // block) % cap).tolist()))
            print(f"call {call} rank {r}: {int(bad.sum())} wrong, rows {sorted(set(rows.tolist()))[:12]}, launches "
                  f"{launches}, programs {items[:10]}; {' '.join(what)}", flush=True)
        # leftovers: slots not armed after the call (every launch re-arms what it read)
        for r, op in enumerate(ops):
            reg = op.ws.local
            if dt == torch.float32:
                nbytes = 3 * W * mt * width * 4
                d = reg[:nbytes].view(torch.int32)
                left = int((d != -(2 ** 31)).sum())
            else:
                nbytes = 3 * W * mt * width * 2
                d = reg[:nbytes].view(torch.int16)
                left = int((d != -32768).sum())
            if left:
                print(f"call {call} rank {r}: {left} data slots left un-armed after the call", flush=True)
                any_bad = True
        bad_calls += any_bad
        prev = ref.double()
    print(f"{bad_calls} of {args.calls} calls bad; wrong elements by kind: {dict(kinds)}", flush=True)
    return 1 if bad_calls else 0


if __name__ == "__main__":
    sys.exit(main())
