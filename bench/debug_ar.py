import os, torch, k3tail
from k3tail import reference as ref
from k3tail.testing import randn, no_multicast
no_multicast()
for pdl in ["0", "1"]:
    os.environ["K3TAIL_DISABLE_PDL"] = pdl
    W, width = 2, 7168
    world = k3tail.LoopbackWorld(W)
    ops = world.build(lambda r: k3tail.OneShotAllReduce(world.group(r), max_tokens=16, width=width))
    for call, M in enumerate([1, 16, 5, 1]):
        xs = [randn((M, width), torch.bfloat16, 10*call + r, device=world.device) for r in range(W)]
        ys = world.run(lambda r: ops[r](xs[r]))
        torch.cuda.synchronize()
        R = ref.all_reduce(xs)
        for r in range(W):
            e = ref.error_stats(ys[r], R)
            bad = (ref.ulp_error(ys[r], R) > 0.5)
            idx = bad.nonzero()[:5].tolist()
            print(f"pdl_off={pdl} call {call} M={M} rank {r}: max_ulp {e['max_ulp']:.2f} nbad {int(bad.sum())} first {idx}",
                  [ (float(ys[r][i,j]), float(R[i,j]), float(xs[0][i,j]), float(xs[1][i,j])) for i,j in idx[:3]])
        print("ctrl", [op.ws.ctrl[:4].tolist() for op in ops])
