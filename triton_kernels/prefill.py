"""Local compute kernels of the large-M (prefill) tail path (DESIGN §3.4).

Above the Lamport capacities the tail moves column *shards*: rank d owns the columns
``[b[d], b[d+1])`` of the width-n latent (``k3tail.prefill.shard_bounds``: the first ``n % W``
ranks one column more).  Per layer, on every rank:

1. ``finalize_shards_kernel`` forms this rank's fp32 routed partial (``numerics.finalize32``:
   exact products, k ascending, -1 slots skipped and their rows never loaded; or
   ``fp32(scale * routed)``) and stores it straight into the *send layout*.  A token whose
   ``expanded_idx`` row holds an index outside ``[-1, R)`` is never read: its partial is zero and
   the kernel sets the caller's ``status`` word, which the large-M path's first exchange carries
   (``PeerExchange.barrier``, ``OneShotAllReduce``: an INDEX fault on every rank).  The concatenation
   over destinations d of the row-major ``[M, b[d+1] - b[d]]`` block (dest d's block starts at
   element ``M * b[d]``).  ``pack_shards_kernel`` copies any ``[M, n]`` tensor (the shared
   partial, an exact 16-bit input) into the same layout.
2. The shards are exchanged by another module (NCCL all-to-all, or a pull over the peer table).
3. ``ordered_sum_kernel`` sums the W received blocks of the own shard in rank order, in fp64,
   rounded once to fp32 (``numerics.rank_sum``), and in the same pass the shard's per-row fp64
   sum of squares of the rounded values (``numerics.sq64``).
4. After the ``[M, W]`` statistics are all-gathered, ``normalize_shard_kernel`` adds them in rank
   order (fp64), forms ``rstd`` with ``numerics.rms_rstd`` over the FULL width and writes
   ``round16(fp32(fp32(x * rstd) * gamma))``: the latent's only rounding.

Protocol.  No slots, no sentinels, no waits: every kernel reads inputs that are complete when it
is launched (stream order) and writes an output that only this launch writes, one element per
program lane, so there are no races and the results are deterministic (fixed reduction trees, no
atomics).  The one cross-rank read is ``ordered_sum_kernel`` in *table mode*: it reads each
source s's block directly from peer memory at ``table[s] + src_off`` elements, with volatile
loads (no stale L1 line).  The caller owns the ordering, by this contract:

* before the launch, a barrier (symmetric-memory barrier / stream wait) that orders every peer's
  writes of its send area (step 1 on that peer) before this rank's reads;
* no peer may overwrite its send area (the next layer's step 1) before every reader of it has
  passed the *next* barrier, which the caller places after this kernel on every rank.

Table entries must be 16-byte aligned device addresses (symmetric-memory bases are
page-aligned); ``BASE_ALIGN`` (host-computed, bytes) is the alignment of ``table[s] + src_off``
elements, stated on the pointer after the cast and the add (AxisInfo ignores a ``multiple_of``
on a loaded value or on a kernel argument: in the sm_90 PTX of Triton 3.6 the loads stayed
scalar with the hint there, and became ``ld.volatile.global.v4`` with it on the pointer).

Grids.  The finalize and pack kernels run one program per (token, chunk): with ``PER_SHARD``
(n % W == 0) a chunk lies inside one destination shard (``CPS`` chunks per shard), so loads
and stores are contiguous and vectorize; otherwise a chunk is a slice of the full row (loads
vectorize, the destination of each column is computed from the constexpr shard width; the
host uses it where n % W != 0, and under the interpreter, whose cost is per program).  All
offsets are int64 (M * n * 4 bytes exceeds 2^31 at prefill sizes).  ``M`` and ``src_off`` are
``do_not_specialize`` (TRITON_NOTES 2: a per-call value must not create a variant).
"""

import triton
import triton.language as tl

from .lamport import idx_in_range, round_to
from .numerics import rms_rstd, routed32, sq64


@triton.jit
def _shard_chunk(pid, M, WIDTH: tl.constexpr, Q: tl.constexpr, R: tl.constexpr,
                 BLOCK: tl.constexpr, CPS: tl.constexpr, CHUNKS: tl.constexpr, PER_SHARD: tl.constexpr):
    """Program ``pid``'s token, absolute columns, mask and send-layout offsets (int64).

    Shard d: ``b[d] = d * Q + min(d, R)``, width ``Q + (d < R)``; element (t, c) of shard d
    goes to ``M * b[d] + t * width_d + (c - b[d])``."""
    t64 = (pid // CHUNKS).to(tl.int64)
    c = pid % CHUNKS
    lane = tl.arange(0, BLOCK)
    if PER_SHARD:  # R == 0: chunk j of shard d (scalars: contiguous, aligned when Q is)
        d = c // CPS
        loc = (c % CPS) * BLOCK + lane
        cmask = loc < Q
        col = d * Q + loc
        dst = (d * Q).to(tl.int64) * M + t64 * Q + loc
    else:  # a slice of the full row; the destination is computed per column
        col = c * BLOCK + lane
        cmask = col < WIDTH
        lo = col < R * (Q + 1)  # the first R shards are one column wider
        if Q > 0:
            d = tl.where(lo, col // (Q + 1), R + (col - R * (Q + 1)) // Q)
        else:
            d = col
        bd = tl.where(lo, d * (Q + 1), d * Q + R)
        wd = tl.where(lo, Q + 1, Q)
        dst = bd.to(tl.int64) * M + t64 * wd + (col - bd)
    return t64, col, cmask, dst


@triton.jit(do_not_specialize=["M", "ROWS"])
def finalize_shards_kernel(
    routed_ptr, eo_ptr, w_ptr, idx_ptr, out_ptr, status_ptr, M, ROWS, scale,
    WIDTH: tl.constexpr, Q: tl.constexpr, R: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK: tl.constexpr, CPS: tl.constexpr, CHUNKS: tl.constexpr, PER_SHARD: tl.constexpr,
    FINALIZE: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    """fp32 routed partial of one (token, chunk) into the send layout: ``finalize32`` (all K row
    loads of the chunk in flight) or ``fp32(routed)``, times ``scale`` when it is not 1.  With the
    triple, a token with an index outside ``[-1, ROWS)`` gets zeros and sets ``status``."""
    t64, col, cmask, dst = _shard_chunk(tl.program_id(0), M, WIDTH, Q, R, BLOCK, CPS, CHUNKS, PER_SHARD)
    if FINALIZE:
        if idx_in_range(idx_ptr, t64, ROWS, TOP_K):
            acc = routed32(t64, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, scale, WIDTH, TOP_K, FINALIZE,
                           HAS_SCALE)
        else:
            tl.atomic_xchg(status_ptr, 1)
            acc = tl.zeros(col.shape, dtype=tl.float32)
    else:
        acc = routed32(t64, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, scale, WIDTH, TOP_K, FINALIZE, HAS_SCALE)
    tl.store(out_ptr + dst, acc, mask=cmask)


@triton.jit(do_not_specialize=["M"])
def pack_shards_kernel(
    x_ptr, out_ptr, M, stride_xm,
    WIDTH: tl.constexpr, Q: tl.constexpr, R: tl.constexpr,
    BLOCK: tl.constexpr, CPS: tl.constexpr, CHUNKS: tl.constexpr, PER_SHARD: tl.constexpr,
):
    """Exact copy of ``x [M, WIDTH]`` (row stride ``stride_xm``) into the send layout."""
    t64, col, cmask, dst = _shard_chunk(tl.program_id(0), M, WIDTH, Q, R, BLOCK, CPS, CHUNKS, PER_SHARD)
    v = tl.load(x_ptr + t64 * stride_xm + col, mask=cmask)
    tl.store(out_ptr + dst, v, mask=cmask)


@triton.jit(do_not_specialize=["M", "src_off"])
def ordered_sum_kernel(
    src_ptr, table_ptr, x_ptr, ss_ptr, M, N, src_off,
    W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TABLE: tl.constexpr, SUMSQ: tl.constexpr, BASE_ALIGN: tl.constexpr,
):
    """``x = fp32(sum_{s in rank order} fp64(block_s))`` for BLOCK_M full rows of the shard
    (the sum starts from source 0 itself, so an all -0.0 column stays -0.0 as in torch), and
    ``ss[t] = sum_cols fp64(x)^2`` (a fixed tree per chunk, chunks in column order).

    Sources: ``src_ptr + s * M * N`` (a local ``[W, M, N]`` tensor), or with ``TABLE`` the
    peer address ``table[s] + src_off`` elements (volatile loads; ``src_ptr`` is then a
    one-element tensor that only carries the dtype)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rmask = rm < M
    lane = tl.arange(0, BLOCK_N)
    blk = rm * 0 + M  # int64 copy of M for the source stride
    ss = tl.zeros([BLOCK_M], dtype=tl.float64)
    c0 = 0
    while c0 < N:  # (a runtime-bound ``for range`` breaks in the interpreter)
        col = c0 + lane
        mask = rmask[:, None] & (col < N)[None, :]
        rel = rm[:, None] * N + col[None, :]
        for s in tl.static_range(W):  # unrolled: all W loads in flight
            if TABLE:
                # the hint goes on the addptr: AxisInfo drops hints on loads and on arguments
                base = tl.multiple_of(tl.load(table_ptr + s).to(src_ptr.dtype) + src_off, BASE_ALIGN)
                v = tl.load(base + rel, mask=mask, other=0.0, volatile=True).to(tl.float64)
            else:
                v = tl.load(src_ptr + (blk * N * s)[:, None] + rel, mask=mask, other=0.0).to(tl.float64)
            if s == 0:
                acc = v
            else:
                acc += v
        x = acc.to(tl.float32)
        tl.store(x_ptr + rel, x, mask=mask)
        if SUMSQ:
            ss += tl.sum(sq64(x), axis=1)  # masked lanes hold +0.0
        c0 += BLOCK_N
    if SUMSQ:
        tl.store(ss_ptr + rm, ss, mask=rmask)


@triton.jit(do_not_specialize=["M"])
def normalize_shard_kernel(
    x_ptr, stats_ptr, gamma_ptr, y_ptr, M, N, eps,
    W: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile (grid axis 0: rows, axis 1: columns) of
    ``y = round(fp32(fp32(x * rstd) * gamma))``, ``rstd = rms_rstd(sum_{s in rank order}
    stats[t, s], WIDTH, eps)`` (``WIDTH`` the full latent width)."""
    DTYPE = y_ptr.dtype.element_ty
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rm < M
    cmask = col < N
    tot = tl.load(stats_ptr + rm * W, mask=rmask, other=1.0)
    for s in tl.static_range(1, W):
        tot += tl.load(stats_ptr + rm * W + s, mask=rmask, other=0.0)
    rstd = rms_rstd(tot, WIDTH, eps)
    mask = rmask[:, None] & cmask[None, :]
    offs = rm[:, None] * N + col[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    g = tl.load(gamma_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, round_to((x * rstd[:, None]) * g[None, :], DTYPE), mask=mask)
