"""project(): the one GEMM family (triton_kernels/gemm.py) at every M against the fp64 reference.

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


SMALL_TILES = {b: {"block_m": 16, "block_n": 16} for b in ("m16", "m256", "large")}  # several tiles per call
CASES = [  # M, N, L, dtype, prefix, shared, shared dtype, tactics
    (1, 96, 520, torch.bfloat16, True, True, torch.float32, None),
    (5, 64, 256, torch.float16, True, False, torch.float32, None),
    (16, 48, 200, torch.bfloat16, False, True, torch.bfloat16, None),
    (3, 40, 136, torch.bfloat16, False, False, torch.float32, None),
    (20, 96, 256, torch.bfloat16, True, True, torch.float32, SMALL_TILES),   # 2 M-tiles, 6 N-tiles
    (40, 96, 520, torch.bfloat16, True, True, torch.float32, None),          # the m256 bucket
    (33, 64, 256, torch.float16, True, True, torch.float16, SMALL_TILES),
    (24, 64, 256, torch.bfloat16, False, False, torch.float32, None),
]


@pytest.mark.parametrize("case", CASES)
def test_project_vs_fp64(case):
    M, N, Lw, dt, hp, hs, sdt, tac = case
    a, w, p, s = _inputs(M, N, Lw, dt, sum(case[:3]), hp, hs, sdt)
    out = k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics=tac)
    ref = R.project(a, w, p, s)
    st = T.check_ulp(out, ref, max_ulp=1.0, frac=0.999, what=f"project {case}")
    T.check_ulp(out, ref, max_ulp=2.0, frac=1.0, what=f"project {case}")
    print(f"project M={M} N={N} L={Lw} {dt} prefix={hp} shared={hs}({sdt}) tiles {tac is not None}: {st}")


def test_project_row_shard_column_slices():
    """A row shard of W_up with non-contiguous column slices of prefix / shared_sum."""
    M, H, Lw, W = 3, 128, 256, 4
    a, w, p, s = _inputs(M, H, Lw, torch.bfloat16, 7, True, True)
    full = R.project(a, w, p, s)
    for r in range(W):
        cols = slice(r * H // W, (r + 1) * H // W)
        for tac in (None, SMALL_TILES):
            out = k3tail.project(a, w[cols], prefix_hidden=p[:, cols], shared_sum=s[:, cols], tactics=tac)
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
    # batch invariance: every row equals the same row projected alone (M = 1, another bucket's tile)
    for row in sorted({0, M // 2, M - 1}):
        one = k3tail.project(a[row:row + 1], w, prefix_hidden=p[row:row + 1], shared_sum=s[row:row + 1])
        assert torch.equal(one.view(torch.int16), out[row:row + 1].view(torch.int16)), f"M={M} N={N} row {row}"


def test_tactics_are_checked():
    a, w, p, s = _inputs(20, 32, 64, torch.bfloat16, 11, True, True)
    with pytest.raises(ValueError, match="unknown"):
        k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"m16": {"block_k": 32}})  # BLOCK_K is fixed
    with pytest.raises(ValueError, match="block_m"):
        k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"large": {"block_m": 24}})
    with pytest.raises(ValueError, match="unknown keys"):
        k3tail.project(a, w, prefix_hidden=p, shared_sum=s, tactics={"triton_max_m": 0})
