"""OneShotAllReduce: CPU ranks under the interpreter (the real multi-rank protocol over
shared memory) and GPU loopback.  Inputs are fresh random draws with -0.0 in them; outputs
are compared bitwise across ranks and in ulps against the fp64 sum."""

import time

import pytest
import torch

import k3tail
from k3tail import reference as ref
from k3tail.testing import check_ulp, randn


def _seed(case, call, rank):
    return 1_000_003 * case + 1009 * call + rank


# ------------------------------------------------------------------ CPU rank bodies
def _rank_correctness(rank, W, cases):
    """Runs every case on this rank; returns the inputs and outputs for the parent to check."""
    out = []
    for ci, (width, max_tokens, dtype, Ms) in enumerate(cases):
        op = k3tail.OneShotAllReduce(max_tokens=max_tokens, width=width, dtype=dtype, timeout_s=60)
        for call, M in enumerate(Ms):
            x = randn((M, width), dtype, _seed(ci, call, rank), scale=2.0)
            y = op(x)
            out.append((ci, call, x, y))
    return out


def _rank_timeout(rank, W):
    """Rank W-1 skips the second call: the others must raise PeerTimeout within the deadline
    and then fail at once; also bad inputs raise ValueError and leave the stages aligned."""
    res = {}
    op = k3tail.OneShotAllReduce(max_tokens=4, width=64, dtype=torch.bfloat16, timeout_s=1.5)
    x = randn((3, 64), torch.bfloat16, 7 + rank)
    bad = {
        "dtype": x.to(torch.float16),
        "float32": x.float(),
        "width": randn((3, 72), torch.bfloat16, 1),
        "ndim": x.reshape(-1),
        "stride": randn((64, 3), torch.bfloat16, 2).t(),
        "too_many_tokens": randn((5, 64), torch.bfloat16, 3),
        "not_a_tensor": [[1.0] * 64],
    }
    res["bad"] = {}
    for name, b in bad.items():
        try:
            op(b)
            res["bad"][name] = "no error"
        except ValueError as e:
            res["bad"][name] = str(e)
    res["ok"] = (x, op(x))  # stages still aligned after the rejected calls
    if rank == W - 1:
        res["skipped"] = True
        time.sleep(4.0)  # stay alive (do not tear down the group) while the others time out
        return res
    t0 = time.monotonic()
    try:
        op(x)
        res["first"] = "no error"
    except k3tail.PeerTimeout as e:
        res["first"] = (type(e).__name__, str(e), time.monotonic() - t0)
    t0 = time.monotonic()
    try:
        op(x)
        res["second"] = "no error"
    except k3tail.PeerTimeout as e:
        res["second"] = (type(e).__name__, str(e), time.monotonic() - t0)
    return res


def _check_correctness(results, cases, W):
    stats = []
    by_key = [{(ci, call): (x, y) for ci, call, x, y in results[r]} for r in range(W)]
    for key in by_key[0]:
        xs = [by_key[r][key][0] for r in range(W)]
        ys = [by_key[r][key][1] for r in range(W)]
        for r in range(1, W):
            assert torch.equal(ys[r].view(torch.int16), ys[0].view(torch.int16)), f"rank {r} differs, case {key}"
        if ys[0].numel():
            stats.append(check_ulp(ys[0], ref.all_reduce(xs), max_ulp=1.0, what=f"W={W} case {key}"))
        else:
            assert ys[0].shape == xs[0].shape
    return stats


CASES_W4 = [
    (7168, 16, torch.bfloat16, [1, 16, 3]),
    (520, 8, torch.float16, [8, 1, 5, 2]),
    (64, 4, torch.bfloat16, [4, 0, 2, 4, 1]),
]
CASES_W3 = [(520, 6, torch.bfloat16, [6, 1, 4]), (7168, 2, torch.float16, [2, 1])]


def test_cpu_w4_bf16_fp16_k3_width():
    """W=4: K3 width 7168 and odd widths, bf16 and fp16, M up to max_tokens and M=0, several
    calls in a row (stage rotation).  Bound: <= 1 ulp (the fp32 rank-order sum is exact unless the summands
    span more than 24 bits of exponent, then fp32 rounding adds at most a hair; observed 0.5)."""
    res = k3tail.spawn(4, _rank_correctness, CASES_W4)
    stats = _check_correctness(res, CASES_W4, 4)
    print("\nW=4 worst max_ulp", max(s["max_ulp"] for s in stats),
          "bias", [f"{s['bias']:+.2e}" for s in stats])


def test_cpu_w3_and_w2():
    for W, cases in ((3, CASES_W3), (2, CASES_W3[:1])):
        res = k3tail.spawn(W, _rank_correctness, cases)
        stats = _check_correctness(res, cases, W)
        print(f"\nW={W} worst max_ulp", max(s["max_ulp"] for s in stats),
              "bias", [f"{s['bias']:+.2e}" for s in stats])


def test_world_size_one_is_a_copy():
    res = k3tail.spawn(1, _rank_correctness, [(16, 4, torch.bfloat16, [3, 0])])
    x, y = res[0][0][2], res[0][0][3]
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_cpu_timeout_poison_and_bad_inputs():
    W = 3
    res = k3tail.spawn(W, _rank_timeout, timeout=120)
    for r in range(W):
        for name, msg in res[r]["bad"].items():
            assert msg != "no error", f"rank {r}: bad input {name!r} was accepted"
        x_ok = [res[q]["ok"][0] for q in range(W)]
        check_ulp(res[r]["ok"][1], ref.all_reduce(x_ok), max_ulp=1.0)
    assert "max_tokens" in res[0]["bad"]["too_many_tokens"]
    assert "dtype" in res[0]["bad"]["dtype"] and "contiguous" in res[0]["bad"]["stride"]
    for r in range(W - 1):
        kind, msg, waited = res[r]["first"]
        assert kind == "PeerTimeout", res[r]["first"]
        assert f"rank {r}" in msg and f"world size {W}" in msg and "OneShotAllReduce" in msg
        assert 1.4 <= waited <= 1.5 + 5.0, waited
        kind2, msg2, waited2 = res[r]["second"]
        assert kind2 == "WorkspacePoisoned" and waited2 < 0.5, res[r]["second"]


def test_construction_errors():
    with pytest.raises(ValueError, match="multiple of 8"):
        k3tail.OneShotAllReduce(max_tokens=4, width=100)
    with pytest.raises(ValueError, match="dtype"):
        k3tail.OneShotAllReduce(max_tokens=4, width=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_tokens"):
        k3tail.OneShotAllReduce(max_tokens=0, width=64)


# ---------------------------------------------------------------------------- GPU
def _loopback_ops(W, max_tokens, width, dtype, timeout_s=20.0):
    world = k3tail.LoopbackWorld(W)
    ops = world.build(lambda r: k3tail.OneShotAllReduce(world.group(r), max_tokens=max_tokens,
                                                        width=width, dtype=dtype, timeout_s=timeout_s))
    return world, ops


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4, 8])
def test_gpu_loopback_eager_and_graph_replay(W):
    k3tail.testing.no_multicast()
    width, T, dtype = 7168, 16, torch.bfloat16
    world, ops = _loopback_ops(W, T, width, dtype)
    dev = world.device
    for call, M in enumerate([1, 16, 5]):
        xs = [randn((M, width), dtype, _seed(W, call, r), device=dev) for r in range(W)]
        ys = world.run(lambda r: ops[r](xs[r]))
        torch.cuda.synchronize()
        for r in range(W):
            assert torch.equal(ys[r].view(torch.int16), ys[0].view(torch.int16))
        check_ulp(ys[0], ref.all_reduce(xs), max_ulp=1.0)
    # CUDA graph: capture once, replay 100 times with fresh inputs copied into static ones
    M = 8
    static_x = [torch.empty(M, width, dtype=dtype, device=dev) for _ in range(W)]
    for r in range(W):
        static_x[r].copy_(randn((M, width), dtype, 5 + r, device=dev))
    world.run(lambda r: ops[r](static_x[r]))  # warm-up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = world.run(lambda r: ops[r](static_x[r]))
    worst = 0.0
    for it in range(100):
        xs = [randn((M, width), dtype, 10_000 + 100 * it + r, device=dev) for r in range(W)]
        for r in range(W):
            static_x[r].copy_(xs[r])
            static_y[r].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for r in range(W):
            assert torch.equal(static_y[r].view(torch.int16), static_y[0].view(torch.int16)), (it, r)
        worst = max(worst, check_ulp(static_y[0], ref.all_reduce(xs), max_ulp=1.0)["max_ulp"])
    for op in ops:
        op.check()
    print(f"\nloopback W={W}: 100 graph replays, worst {worst} ulp")


@pytest.mark.gpu
def test_gpu_loopback_timeout_and_poison():
    k3tail.testing.no_multicast()
    W = 4
    world, ops = _loopback_ops(W, 4, 1024, torch.bfloat16, timeout_s=1.0)
    dev = world.device
    xs = [randn((2, 1024), torch.bfloat16, r, device=dev) for r in range(W)]
    world.run(lambda r: ops[r](xs[r]))
    torch.cuda.synchronize()
    t0 = time.monotonic()
    world.run(lambda r: ops[r](xs[r]) if r < W - 1 else None)  # rank W-1 never arrives
    torch.cuda.synchronize()
    waited = time.monotonic() - t0
    assert waited < 1.0 + 5.0, waited
    for r in range(W - 1):
        with pytest.raises(k3tail.PeerTimeout, match=f"rank {r} of world size {W}"):
            ops[r].check()
        t0 = time.monotonic()
        with pytest.raises(k3tail.WorkspacePoisoned):
            ops[r](xs[r])
        assert time.monotonic() - t0 < 0.5


def _rank_symm_mem(rank, W, width, calls):
    import torch as _t
    dev = _t.device("cuda", _t.cuda.current_device())
    op = k3tail.OneShotAllReduce(max_tokens=4, width=width, timeout_s=60, device=dev)
    assert op.ws.backend == "symm_mem" and op.ws.multicast_ptr == 0
    out = []
    for c in range(calls):
        x = randn((3, width), _t.bfloat16, 77 * c + rank, device=dev)
        out.append((x.cpu(), op(x).cpu()))
    return out


@pytest.mark.gpu
def test_gpu_symm_mem_processes_on_one_gpu():
    """torch symmetric memory with two processes on one GPU (overlapping devices allowed,
    gloo process group since NCCL refuses two ranks on one GPU)."""
    W, width = 2, 2048
    res = k3tail.spawn(W, _rank_symm_mem, width, 3, device="cuda", backend="gloo", timeout=240,
                       env={"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    for c in range(3):
        xs = [res[r][c][0] for r in range(W)]
        assert torch.equal(res[0][c][1].view(torch.int16), res[1][c][1].view(torch.int16))
        check_ulp(res[0][c][1], ref.all_reduce(xs), max_ulp=1.0)
