"""Local kernels of the large-M (prefill) tail path, DESIGN §3.4 (kernels: triton_kernels/prefill.py).

Shards: rank d owns the columns ``[b[d], b[d+1])`` of a width-n row, ``b = shard_bounds(n, W)``
(the first ``n % W`` ranks get one column more).  The *send layout* of an ``[M, n]`` matrix is
the concatenation over d of the row-major ``[M, b[d+1] - b[d]]`` block (dest d's block starts at
element ``M * b[d]``), so an exchange moves one contiguous block per peer.

Per rank: :func:`finalize_to_shards` (fp32 routed partial, ``numerics.routed_partial``'s bits) or
:func:`pack_shards` (exact copy, e.g. the 16-bit shared partial) into the send layout; the
exchange (elsewhere); :func:`ordered_sum` (rank-order fp64 sum rounded once to fp32, and the
shard's fp64 sum of squares); an all-gather of the ``[M, W]`` statistics (elsewhere);
:func:`normalize_shard` (rstd over the full width, one rounding).  Concatenated over shards the
result equals ``numerics.rms_normalize(numerics.rank_sum(partials), gamma, eps, dtype)`` bit
for bit (up to the ~2^-17 chance per row that the fp64 sum of squares, summed in another order,
straddles an fp32 rounding boundary of rstd).  ``*_torch`` are the pure-torch twins.

The kernels communicate nothing, except :func:`ordered_sum` with ``src_table``, which reads the
peers' send areas directly; its ordering contract is in ``triton_kernels/prefill.py``.

Tactics (optional ``tactics=`` dicts): finalize/pack ``block`` (columns per program, a power of
two >= 16), ``num_warps``, ``per_shard`` (chunks inside one shard; only when n % W == 0, the
GPU default there); ordered_sum/normalize ``block_n``, ``block_m`` (tile columns / rows), ``num_warps``.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

from k3tail.runtime import launch as L
from k3tail import numerics
from k3tail.numerics import f32
from k3tail.triton_kernels.prefill import (finalize_shards_kernel, normalize_shard_kernel, ordered_sum_kernel,
                                     pack_shards_kernel)
from k3tail.runtime.modes import interpret_mode
from k3tail.runtime.checks import check_routed, check_tensor, routed_rows
from k3tail.config import ACT_DTYPES

EXPERT_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit: finalize32's products are exact
ROUTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WARPS = (1, 2, 4, 8, 16, 32)


def shard_bounds(n: int, W: int) -> list[int]:
    """The W + 1 column boundaries of the shards: ``b[d] = d * (n // W) + min(d, n % W)``."""
    n, W = _int("n", n, 0), _int("W", W, 1)
    q, r = divmod(n, W)
    return [d * q + min(d, r) for d in range(W + 1)]


# ------------------------------------------------------------------------------ validation
def _int(name, v, lo):
    try:
        if isinstance(v, bool):
            raise TypeError
        v = operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {v!r}") from None
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def _bounds(bounds, n: Optional[int] = None):
    """``(n, W)`` of ``bounds``, which must be ``shard_bounds(n, W)`` (the kernels compute the
    boundaries from n and W)."""
    if not isinstance(bounds, (list, tuple)) or len(bounds) < 2:
        raise ValueError(f"bounds must be a list of W + 1 ints (shard_bounds(n, W)), got {bounds!r}")
    b = [_int("bounds[i]", x, 0) for x in bounds]
    W = len(b) - 1
    if n is not None and b[-1] != n:
        raise ValueError(f"bounds end at {b[-1]} but the rows have {n} columns")
    if b != shard_bounds(b[-1], W):
        raise ValueError(f"bounds must be shard_bounds({b[-1]}, {W}) = {shard_bounds(b[-1], W)}, got {b}")
    return b[-1], W


def _tactics(tactics, known):
    t = dict(tactics or {})
    unknown = set(t) - set(known)
    if unknown:
        raise ValueError(f"tactics has unknown keys {sorted(unknown)} (known: {sorted(known)})")
    return t


def _pow2(name, v, lo=1):
    v = _int(f"tactics[{name!r}]", v, lo)
    if v & (v - 1):
        raise ValueError(f"tactics[{name!r}] must be a power of two >= {lo}, got {v}")
    return v


def _warps(t, default=4):
    w = _int("tactics['num_warps']", t.get("num_warps", default), 1)
    if w not in _WARPS:
        raise ValueError(f"tactics['num_warps'] must be a power of two in 1..32, got {w}")
    return w


def _flat_out(out, numel, dtype, device):
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    check_tensor("out", out, dtype=dtype, device=device, ndim=1)
    if out.numel() < numel:
        raise ValueError(f"out has {out.numel()} elements but the send layout needs {numel}")
    return out[:numel]


def _shard_launch(kernel, M, n, W, tactics, ptrs, scalars, **constexprs):
    """Launch a finalize/pack kernel: one program per (token, chunk) (see the kernel file)."""
    t = _tactics(tactics, ("block", "num_warps", "per_shard"))
    q, r = divmod(n, W)
    # per-shard programs where n % W == 0 (contiguous, vectorized stores); the interpreter runs
    # one program per token by default (its cost is per program)
    per_shard = bool(t.get("per_shard", r == 0 and not interpret_mode()))
    if per_shard and r:
        raise ValueError(f"tactics['per_shard'] needs n % W == 0 (n={n}, W={W})")
    span = q if per_shard else n
    block = _pow2("block", t.get("block", max(16, min(4096 if interpret_mode() else 1024, L.next_pow2(span)))), 16)
    cps = -(-span // block)
    chunks = W * cps if per_shard else cps
    if M * chunks >= 2 ** 31:
        raise ValueError(f"{M} rows x {chunks} chunks exceed the 1-D grid: raise tactics['block']")
    L.launch(kernel, (M * chunks,), *ptrs, M, *scalars, WIDTH=n, Q=q, R=r, BLOCK=block,
             CPS=cps, CHUNKS=chunks, PER_SHARD=per_shard, num_warps=_warps(t), **constexprs)


def _tile(t, M, n, gpu_tile):
    """``(block_m, block_n)`` of a row-tile kernel: few, large programs under the interpreter."""
    cap = 16384 if interpret_mode() else gpu_tile
    bn = _pow2("block_n", t.get("block_n", max(16, min(L.next_pow2(n), cap))), 16)
    bm = _pow2("block_m", t.get("block_m", max(1, min(L.next_pow2(M), cap // bn, 64))))
    return bm, bn


# ------------------------------------------------------------------------------ finalize / pack
def finalize_to_shards(*, routed=None, expert_out=None, expert_weights=None, expanded_idx=None,
                       scale: float = 1.0, bounds, out=None, tactics: Optional[dict] = None,
                       status: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's fp32 routed partial ``[M * n]`` in the send layout of ``bounds``.

    ``routed [M, n]`` (bf16/fp16/fp32) gives ``fp32(scale * routed)``; the triple (``expert_out
    [R, n]`` bf16/fp16, ``expert_weights [M, K]`` bf16/fp16/fp32, ``expanded_idx [M, K]`` int32,
    -1 skips a slot and its row is never read) gives ``numerics.routed_partial``'s bits.
    ``out``: optional fp32 1-D tensor of at least ``M * n`` elements (e.g. a view into a symmetric
    send area); the returned tensor is ``out[:M * n]``.  ``status``: optional int32 ``[1]`` word on
    the device, set to 1 when a token's ``expanded_idx`` holds an index outside ``[-1, R)`` (that
    token's partial is then zero; no expert row out of range is read)."""
    n, W = _bounds(bounds)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale must be a float, got {scale!r}")
    dev = (routed if routed is not None else expanded_idx if expanded_idx is not None else expert_out)
    dev = dev.device if isinstance(dev, torch.Tensor) else None
    finalize = check_routed(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                            expanded_idx=expanded_idx, M=None, width=n, top_k=None, dtype=None, device=dev,
                            routed_dtypes=ROUTED_DTYPES, expert_dtypes=EXPERT_DTYPES)
    M = routed_rows(routed, expanded_idx)
    K = expanded_idx.shape[1] if finalize else 1
    out = _flat_out(out, M * n, torch.float32, dev)
    if M * n == 0:
        return out
    dummy = out
    rows = expert_out.shape[0] if finalize else 0
    if status is not None:
        check_tensor("status", status, dtype=torch.int32, device=dev, ndim=1, shape=(1,))
    st = status if status is not None else _status_dummy(dev)
    ptrs = (routed if routed is not None else dummy, expert_out if finalize and rows else dummy,
            expert_weights if finalize else dummy, expanded_idx if finalize else dummy, out, st)
    _shard_launch(finalize_shards_kernel, M, n, W, tactics, ptrs, (rows, f32(scale)), TOP_K=K, FINALIZE=finalize,
                  HAS_SCALE=float(scale) != 1.0)
    return out


_STATUS: dict = {}


def _status_dummy(dev) -> torch.Tensor:
    """A status word for callers that pass none (set on an index out of range, read by nobody)."""
    t = _STATUS.get(dev)
    if t is None:
        t = _STATUS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return t


def pack_shards(x: torch.Tensor, bounds, out=None, tactics: Optional[dict] = None) -> torch.Tensor:
    """``x [M, n]`` (any dtype, unit column stride) copied exactly into the send layout ``[M * n]``
    (same dtype), one launch.  ``out``: optional 1-D tensor of at least ``M * n`` elements."""
    check_tensor("x", x, ndim=2, contiguous=False)
    n, W = _bounds(bounds, x.shape[1])
    M = x.shape[0]
    if M * n and x.stride(1) != 1:
        raise ValueError(f"x must have unit column stride (got strides {x.stride()})")
    out = _flat_out(out, M * n, x.dtype, x.device)
    if M * n == 0:
        return out
    _shard_launch(pack_shards_kernel, M, n, W, tactics, (x, out), (x.stride(0),))
    return out


# ------------------------------------------------------------------------------ sum / normalize
_DTYPE_CARRIERS: dict = {}


def ordered_sum(*, M, n, dtype_in, src=None, src_table=None, src_offset_elems=0, sumsq=True,
                out=None, sumsq_out=None, tactics: Optional[dict] = None):
    """``(x32 [M, n] fp32, ss64 [M] fp64 or None)``: ``x32 = fp32(sum_{s in rank order}
    fp64(block_s))`` over W row-major ``[M, n]`` blocks of ``dtype_in``, ``ss64 = sum_cols
    fp64(x32)^2`` (deterministic, no atomics).  Blocks: ``src [W, M, n]`` (local), or
    ``src_table`` (int64 ``[W]`` device addresses, 16-byte aligned; block s at ``src_table[s] +
    src_offset_elems`` elements, read with volatile loads: see the contract in the kernel file)."""
    M, n = _int("M", M, 0), _int("n", n, 0)
    if dtype_in not in SUM_DTYPES:
        raise ValueError(f"dtype_in must be one of {list(SUM_DTYPES)}, got {dtype_in}")
    if (src is None) == (src_table is None):
        raise ValueError("src: pass exactly one of src (a [W, M, n] tensor) and src_table (int64 addresses)")
    off = _int("src_offset_elems", src_offset_elems, 0)
    if src is not None:
        check_tensor("src", src, dtype=dtype_in, ndim=3, shape=(None, M, n))
        if off:
            raise ValueError("src_offset_elems applies to src_table only")
        W, dev = src.shape[0], src.device
    else:
        check_tensor("src_table", src_table, dtype=torch.int64, ndim=1)
        W, dev = src_table.shape[0], src_table.device
    if W < 1:
        raise ValueError("src/src_table must name at least one source")
    if out is None:
        out = torch.empty(M, n, dtype=torch.float32, device=dev)
    else:
        check_tensor("out", out, dtype=torch.float32, device=dev, ndim=2, shape=(M, n))
    ss = None
    if sumsq:
        if sumsq_out is None:
            ss = torch.empty(M, dtype=torch.float64, device=dev)
        else:
            ss = check_tensor("sumsq_out", sumsq_out, dtype=torch.float64, device=dev, ndim=1, shape=(M,))
    elif sumsq_out is not None:
        raise ValueError("sumsq_out given with sumsq=False")
    if M == 0 or n == 0:
        if ss is not None:
            ss.zero_()
        return out, ss
    t = _tactics(tactics, ("block_n", "block_m", "num_warps"))
    bm, bn = _tile(t, M, n, 512)
    esize = torch.empty((), dtype=dtype_in).element_size()
    align = 16  # bytes: the alignment of table[s] + off elements (table entries are 16-aligned)
    while (off * esize) % align:
        align //= 2
    if src is None:
        key = (dtype_in, dev)
        if key not in _DTYPE_CARRIERS:
            _DTYPE_CARRIERS[key] = torch.empty(16 // esize, dtype=dtype_in, device=dev)
        src = _DTYPE_CARRIERS[key]  # carries the element type into the kernel; never read
    L.launch(ordered_sum_kernel, (-(-M // bm),), src, src_table if src_table is not None else out, out,
             ss if ss is not None else out, M, n, off, W=W, BLOCK_M=bm, BLOCK_N=bn,
             TABLE=src_table is not None, SUMSQ=ss is not None, BASE_ALIGN=align, num_warps=_warps(t))
    return out, ss


def normalize_shard(x32, stats64, gamma_shard, *, eps: float, width: int, dtype, out=None,
                    tactics: Optional[dict] = None) -> torch.Tensor:
    """The own shard of the normed latent, ``[M, n]`` in ``dtype`` (bf16/fp16):
    ``round(fp32(fp32(x32 * rstd) * gamma))``, ``rstd = numerics.rms_rstd`` of the full-width
    sum of squares ``sum_{s in rank order} stats64[t, s]`` (``stats64 [M, W]`` fp64, the
    all-gathered :func:`ordered_sum` statistics) over ``width`` columns."""
    if dtype not in ACT_DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    check_tensor("x32", x32, dtype=torch.float32, ndim=2)
    M, n = x32.shape
    dev = x32.device
    check_tensor("stats64", stats64, dtype=torch.float64, device=dev, ndim=2, shape=(M, None))
    W = stats64.shape[1]
    if W < 1:
        raise ValueError("stats64 must have at least one column (one per rank)")
    # a slice of gamma at an uneven shard boundary (W = 3: 1195 columns) need not be 16-byte aligned;
    # the kernel's gamma loads assume nothing (Triton specializes the pointer's alignment itself)
    check_tensor("gamma_shard", gamma_shard, dtypes=(dtype, torch.float32), device=dev, ndim=1, shape=(n,),
                   aligned=False)
    width = _int("width", width, max(1, n))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if out is None:
        out = torch.empty(M, n, dtype=dtype, device=dev)
    else:
        check_tensor("out", out, dtype=dtype, device=dev, ndim=2, shape=(M, n))
    if M * n == 0:
        return out
    t = _tactics(tactics, ("block_n", "block_m", "num_warps"))
    bm, bn = _tile(t, M, n, 1024)
    L.launch(normalize_shard_kernel, (-(-M // bm), -(-n // bn)), x32, stats64, gamma_shard, out, M, n, f32(eps),
             W=W, WIDTH=width, BLOCK_M=bm, BLOCK_N=bn, num_warps=_warps(t))
    return out


# ------------------------------------------------------------------------------ torch twins
def pack_shards_torch(x: torch.Tensor, bounds) -> torch.Tensor:
    """Twin of :func:`pack_shards`."""
    b = list(bounds)
    return torch.cat([x[:, lo:hi].reshape(-1) for lo, hi in zip(b, b[1:])])


def finalize_to_shards_torch(*, routed=None, expert_out=None, expert_weights=None, expanded_idx=None,
                             scale: float = 1.0, bounds) -> torch.Tensor:
    """Twin of :func:`finalize_to_shards`: ``numerics.routed_partial`` in the send layout."""
    p = numerics.routed_partial(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                                expanded_idx=expanded_idx, scale=scale)
    return pack_shards_torch(p, bounds)


def ordered_sum_torch(blocks: torch.Tensor, sumsq: bool = True):
    """Twin of :func:`ordered_sum` on ``blocks [W, M, n]``: x32 has the kernel's bits; ss64 is the
    same fp64 sum in torch's order (equal to ~1e-16 relative, not necessarily bit for bit)."""
    x32 = numerics.rank_sum(list(blocks))
    ss = (x32.double() * x32.double()).sum(-1) if sumsq else None
    return x32, ss


def normalize_shard_torch(x32, stats64, gamma_shard, *, eps: float, width: int, dtype) -> torch.Tensor:
    """Twin of :func:`normalize_shard` (bit for bit)."""
    tot = stats64[:, 0]
    for s in range(1, stats64.shape[1]):
        tot = tot + stats64[:, s]
    ms = (tot / width + f32(eps))[:, None]
    rstd = torch.div(torch.ones_like(ms), torch.sqrt(ms)).float()
    return ((x32.float() * rstd) * gamma_shard.float()).to(dtype)
