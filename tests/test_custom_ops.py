"""torch.library custom ops: fake implementations and torch.compile(fullgraph=True) through them.

The compile test uses ``backend="aot_eager"`` (dynamo + AOTAutograd tracing with the fake
implementations, eager kernels): CPU inductor would spend its time compiling C++ for a graph
whose only real work is the custom op.  The compiled result must equal the eager op
bit-for-bit on every rank (W=2 CPU ranks).
"""

import pytest
import torch

import k3tail
from k3tail.ops import custom_ops as C
from k3tail import testing as T


def _inputs(rank, width=256, hidden=512, M=3, K=4):
    eo, w, idx = T.moe_triple(M, K, width, torch.bfloat16, seed=100 + rank)
    return dict(expert_out=eo, expert_weights=w, expanded_idx=idx,
                norm_weight=T.randn((width,), torch.bfloat16, 7, neg_zeros=False),
                residual=T.randn((M, width), torch.bfloat16, 8),
                shared=T.randn((M, width), torch.bfloat16, 200 + rank),
                lane_shared=T.randn((M, hidden), torch.bfloat16, 300 + rank))


def _compile_world(rank, W):
    torch._dynamo.config.cache_size_limit = 64
    op = k3tail.FinalizeAllReduceRMSNorm(width=256, max_tokens=4, routed_scale=0.5)
    lane = k3tail.LaneAllReduce(latent=256, hidden=512, max_tokens=4)
    d = _inputs(rank)
    f_op, f_lane = op.as_custom_op(), lane.as_custom_op()

    def body(eo, w, idx, g, res, sh, lsh):
        n1, r1 = f_op(norm_weight=g, expert_out=eo, expert_weights=w, expanded_idx=idx, shared=sh, residual=res)
        n2 = f_op(norm_weight=g, routed=n1)
        n3, ss = f_lane(norm_weight=g, shared=lsh, expert_out=eo, expert_weights=w, expanded_idx=idx)
        return n1, r1, n2, n3, ss

    args = (d["expert_out"], d["expert_weights"], d["expanded_idx"], d["norm_weight"], d["residual"],
            d["shared"], d["lane_shared"])
    eager = body(*args)
    direct1 = op(norm_weight=d["norm_weight"], expert_out=d["expert_out"], expert_weights=d["expert_weights"],
                 expanded_idx=d["expanded_idx"], shared=d["shared"], residual=d["residual"])
    compiled = torch.compile(body, fullgraph=True, backend="aot_eager")(*args)
    return eager, compiled, direct1


def test_compile_fullgraph_w2():
    res = k3tail.spawn(2, _compile_world)
    for r in range(2):
        eager, compiled, direct1 = res[r]
        for a, b in zip(eager, compiled):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"rank {r}: compiled != eager"
        assert torch.equal(eager[0].view(torch.int16), direct1[0].view(torch.int16))
        assert torch.equal(eager[1].view(torch.int16), direct1[1].view(torch.int16))
        assert not torch.isnan(eager[0].float()).any()
    for a, b in zip(res[0][1], res[1][1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "ranks differ"


@pytest.mark.skipif(torch.cuda.is_available(), reason="in-process W=1 CPU test")
def test_fake_impls_w1():
    op = k3tail.FinalizeAllReduceRMSNorm(width=256, max_tokens=4)
    lane = k3tail.LaneAllReduce(latent=256, hidden=512, max_tokens=4)
    d = _inputs(0)
    h1, h2 = C.register(op), C.register(lane)
    args1 = (h1, d["norm_weight"], None, d["expert_out"], d["expert_weights"], d["expanded_idx"], None,
             d["residual"])
    args2 = (h2, d["norm_weight"], d["lane_shared"], None, d["expert_out"], d["expert_weights"],
             d["expanded_idx"])
    torch.library.opcheck(torch.ops.k3tail.finalize_allreduce_rmsnorm.default, args1,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.k3tail.lane_allreduce.default, args2,
                          test_utils=("test_schema", "test_faketensor"))
    n = C.finalize_allreduce_rmsnorm(op, norm_weight=d["norm_weight"], routed=d["residual"])
    assert torch.equal(n.view(torch.int16), op(norm_weight=d["norm_weight"], routed=d["residual"]).view(torch.int16))
    with pytest.raises(ValueError, match="handle"):
        C.lookup(10 ** 9)
