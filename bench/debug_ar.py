import os, sys, torch, k3tail
from k3tail import reference as ref
from k3tail.testing import randn, no_multicast
no_multicast()
os.environ["K3TAIL_DISABLE_PDL"] = "1"
for mode in sys.argv[1:]:
    os.environ["K3TAIL_DEBUG_REARM"] = mode
    for W in (2, 4):
        width = 7168
        world = k3tail.LoopbackWorld(W)
        ops = world.build(lambda r: k3tail.OneShotAllReduce(world.group(r), max_tokens=16, width=width))
        for call, M in enumerate([1, 16, 5]):
            xs = [randn((M, width), torch.bfloat16, 10*call + r, device=world.device) for r in range(W)]
            ys = world.run(lambda r: ops[r](xs[r]))
            torch.cuda.synchronize()
            R = ref.all_reduce(xs)
            line = []
            for r in range(W):
                bad = (ref.ulp_error(ys[r], R) > 0.5)
                nb = int(bad.sum())
                kinds = {}
                for i, j in bad.nonzero()[:200].tolist():
                    v = float(ys[r][i, j])
                    # which subset of ranks' contributions does v equal?
                    found = "other"
                    for mask in range(1, 1 << W):
                        sv = sum(float(xs[q][i, j]) for q in range(W) if mask >> q & 1)
                        if abs(float(torch.tensor(sv).to(torch.bfloat16)) - v) == 0:
                            found = "sum of " + "".join(str(q) for q in range(W) if mask >> q & 1); break
                    if torch.isnan(torch.tensor(v)): found = "nan"
                    kinds[found] = kinds.get(found, 0) + 1
                line.append(f"r{r}: nbad {nb} {kinds}")
            print(f"mode {mode} W={W} call {call} M={M}: " + " | ".join(line), flush=True)
        for op in ops:
            op.ws.check("x", 1)
