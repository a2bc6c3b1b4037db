"""project(): Triton skinny GEMM path and large-M path against the fp64 reference.

Bound: one rounding of an fp32 value (fp32 accumulation over L) -> <= 1 ulp for >= 99.9 % of
elements and <= 2 ulp for all of them; the signed bias is printed (pytest -s).
"""

import pytest
import torch

import k3tail
from k3tail import reference as R
from k3tail import testing as T


def _inputs(M, N, Lw, dtype, seed, prefix, shared, sdtype=torch.float32, device="cpu"):
    a = T.randn((M, Lw), dtype, seed, device=device)
    w = T.randn((N, Lw), dtype, seed + 1, scale=0.05, device=device)
    p = T.randn((M, N), dtype, seed + 2, device=device) if prefix else None
    s = T.randn((M, N), torch.float32, seed + 3, device=device).to(sdtype) if shared else None
    return a, w, p, s


CASES = [  # M, N, L, dtype, prefix, shared, shared dtype, triton_max_m
    (1, 96, 520, torch.bfloat16, True, True, torch.float32, 16),
    (5, 64, 256, torch.float16, True, False, torch.float32, 16),
    (16, 48, 200, torch.bfloat16, False, True, torch.bfloat16, 16),
    (3, 40, 136, torch.bfloat16, False, False, torch.float32, 16),
    (20, 96, 256, torch.bfloat16, True, True, torch.float32, 64),    # Triton path, 2 M-blocks
    (40, 96, 520, torch.bfloat16, True, True, torch.float32, 16),    # large-M path
    (33, 64, 256, torch.float16, True, True, torch.float16, 16),     # large-M path
    (24, 64, 256, torch.bfloat16, False, False, torch.float32, 16),  # large-M path
]


@pytest.mark.parametrize("case", CASES)
def test_project_vs_fp64(case):
    M, N, Lw, dt, hp, hs, sdt, tmax = case
    a, w, p, s = _inputs(M, N, Lw, dt, sum(case[:3]), hp, hs, sdt)
    out = k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"triton_max_m": tmax})
    ref = R.project(a, w, p, s)
    st = T.check_ulp(out, ref, max_ulp=1.0, frac=0.999, what=f"project {case}")
    T.check_ulp(out, ref, max_ulp=2.0, frac=1.0, what=f"project {case}")
    print(f"project M={M} N={N} L={Lw} {dt} prefix={hp} shared={hs}({sdt}) triton<= {tmax}: {st}")


def test_project_row_shard_column_slices():
    """A row shard of W_up with non-contiguous column slices of prefix / shared_sum."""
    M, H, Lw, W = 3, 128, 256, 4
    a, w, p, s = _inputs(M, H, Lw, torch.bfloat16, 7, True, True)
    full = R.project(a, w, p, s)
    for r in range(W):
        cols = slice(r * H // W, (r + 1) * H // W)
        for tmax in (16, 0):
            out = k3tail.project(a, w[cols], prefix_hidden=p[:, cols], shared_sum=s[:, cols],
                                 tactics={"triton_max_m": tmax})
            T.check_ulp(out, full[:, cols], max_ulp=1.0, frac=0.999, what=f"shard {r}")


def test_project_out_dtype_and_errors():
    a, w, p, s = _inputs(2, 32, 64, torch.bfloat16, 9, True, True)
    out = k3tail.project(a, w, prefix_hidden=p, shared_sum=s, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = R.project(a, w, p, s)
    assert float((R.f64(out) - ref).abs().max() / ref.abs().max()) < 1e-5
    assert k3tail.project(a[:0], w).shape == (0, 32)
    for name, kw in [("normed", dict(normed=a.float(), up_weight=w)),
                     ("up_weight", dict(normed=a, up_weight=w.half())),
                     ("up_weight", dict(normed=a, up_weight=w[:, :32])),
                     ("prefix", dict(normed=a, up_weight=w, prefix_hidden=p[:1])),
                     ("shared_sum", dict(normed=a, up_weight=w, shared_sum=s.double())),
                     ("out_dtype", dict(normed=a, up_weight=w, out_dtype=torch.int32)),
                     ("tactics", dict(normed=a, up_weight=w, tactics={"x": 1}))]:
        with pytest.raises(ValueError, match=name):
            k3tail.project(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("N", [896, 7168])
def test_gpu_project_k3(M, N):
    a, w, p, s = _inputs(M, N, 3584, torch.bfloat16, M + N, True, True, device="cuda")
    out = k3tail.project(a, w, prefix_hidden=p, shared_sum=s)
    st = T.check_ulp(out, R.project(a, w, p, s), max_ulp=1.0, frac=0.999, what=f"gpu project M={M} N={N}")
    print(f"gpu project M={M} N={N}: {st}")
    if M > 16:  # the large-M path: the torch epilogue (4 passes) must give the default Triton one's bits
        tch = k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"epilogue": "torch"})
        assert torch.equal(tch.view(torch.int16), out.view(torch.int16)), f"M={M} N={N}"


@pytest.mark.parametrize("M,N,dt,sdt,hp,hs,out_dt", [
    (20, 96, torch.bfloat16, torch.float32, True, True, None),
    (33, 72, torch.float16, torch.float16, True, True, None),
    (17, 40, torch.bfloat16, torch.bfloat16, False, True, None),
    (40, 64, torch.bfloat16, torch.float32, True, False, torch.float32),
    (18, 24, torch.bfloat16, torch.float32, False, False, None),
])
def test_triton_epilogue_bitwise_equal_torch(M, N, dt, sdt, hp, hs, out_dt):
    """Large-M path: the one-pass Triton epilogue gives the torch epilogue's bits (same fp32
    additions in the same order, one RNE rounding), on column slices of wider tensors too."""
    Lw = 136
    a, w, p, s = _inputs(M, 2 * N, Lw, dt, M + N, hp, hs, sdt)
    cols = slice(N // 2, N // 2 + N)  # strided views: columns of [M, 2N]
    kw = dict(prefix_hidden=p[:, cols] if hp else None, shared_sum=s[:, cols] if hs else None, out_dtype=out_dt)
    base = k3tail.project(a, w[cols], tactics={"triton_max_m": 0, "epilogue": "torch"}, **kw)
    tri = k3tail.project(torch.ones_like(a), w[cols], tactics={"triton_max_m": 0, "epilogue": "torch"}, **kw)  # control: other inputs, other bits
    assert not torch.equal(tri, base)
    tri = k3tail.project(a, w[cols], tactics={"triton_max_m": 0, "epilogue": "triton"}, **kw)
    assert tri.dtype == base.dtype
    assert torch.equal(tri.view(torch.int16 if tri.element_size() == 2 else torch.int32),
                       base.view(torch.int16 if base.element_size() == 2 else torch.int32))
    ref = R.project(a, w[cols], kw["prefix_hidden"], kw["shared_sum"])
    if out_dt is None:
        T.check_ulp(tri, ref, max_ulp=2.0, frac=1.0, what="triton epilogue")


def test_triton_epilogue_is_the_default(monkeypatch):
    """The large-M path's default epilogue is the Triton one (timed faster on the H200)."""
    from k3tail.ops import projection as P
    a, w, p, s = _inputs(20, 32, 64, torch.bfloat16, 12, True, True)
    calls = []
    real = P._epilogue_triton
    monkeypatch.setattr(P, "_epilogue_triton", lambda *x, **k: calls.append(1) or real(*x, **k))
    k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"triton_max_m": 0})
    assert calls == [1]
    k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"triton_max_m": 0, "epilogue": "torch"})
    assert calls == [1]


def test_epilogue_tactic_is_checked():
    a, w, p, s = _inputs(20, 32, 64, torch.bfloat16, 11, True, True)
    with pytest.raises(ValueError, match="epilogue"):
        k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"triton_max_m": 0, "epilogue": "cuda"})
