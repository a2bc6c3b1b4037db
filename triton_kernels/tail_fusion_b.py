"""TAIL_FUSION kernel B: the sharded skinny up-projection with the fused epilogue (DESIGN §3.2).

Part of the three-kernel decode tail A -> B -> C of ``triton_kernels/tail_fusion.py``: the
buffers, A, C and the proof that one stage of slots suffices are there; this file holds B's
two variants and their shared epilogue.  B's part of the protocol:

(B) ``tail_b_kernel``: skinny GEMM ``acc[16, BLOCK_N] = normed[0:16 (masked to M), :] @
    W_up_shard[n-block, :]^T`` with ``tl.dot`` on 16-bit inputs, fp32 accumulation.  Grid:
    N-blocks x SPLIT_K.  Right after ``gdc_wait`` every program reads the poison flag and
    loads its epilogue operands (``rs32`` tile and prefix shard tile, fp32), then streams
    the weights at once: the flag only gates the stores, the operands are not a second
    round trip after the K loop.  SPLIT_K > 1: each program stores its fp32 partial, the
    last arriving program of an N-block (``cnt_b``) adds the partials in split order
    (deterministic) and runs the epilogue.
    ``tail_b_gemv_kernel`` (the host picks it when M <= tactic ``b_gemv_max_m`` <= 4): no
    ``tl.dot``, no split-K; program p owns ``ROWS`` rows of the shard, loads its whole
    [ROWS, L] weight tile (K padded to a power of two, masked), the epilogue operands and
    the M rows of ``normed`` together, and computes each token's row ``sum_k w * a`` with
    fp32 products (exact for 16-bit inputs) and fp32 sums, then the same epilogue.
    Epilogue (one function, both kernels): ``acc + rs32 + prefix shard`` in fp32, ONE
    rounding (``round_to``), canonicalize, store into columns [rank*S, ...) of EVERY
    rank's mailbox (unicast stores through the peer table).  A multicast-store variant
    (``MULTICAST``, chosen only when the workspace reports a multicast address, the shard
    width is even and the N tile is even: never on this project's machines; CI assembles it
    for sm_90, nothing runs it) stores once through the multicast address with
    ``multimem.st.b32``, two adjacent 16-bit columns per word (ptxas has no 16-bit
    multimem.st; masked-off pairs are redirected to the pad instead of predicating the
    instruction, which ptxas is reported to mishandle).  B never waits;
    on a poisoned workspace it stores nothing (no partials, no counter update, nothing
    into any mailbox).

What the chain argument of ``tail_fusion.py`` needs from B: B never waits (no peer memory is
polled); every B program calls ``gdc_wait`` (PDL) before it reads A's local scratch
(``normed``, ``rs32``) and before its first remote (mailbox) store, so "B(n) started" implies
"A(n) complete, re-arms included"; B writes only columns ``[rank*S, (rank+1)*S)`` of every
rank d's mailbox, which d's C re-arms after reading them; on a poisoned workspace it stores nothing.
"""

import triton
import triton.language as tl

from .lamport import INTERPRET, canonicalize, is_poisoned, round_to
from .lamport import shard_of  # issue 20: uneven column shards (any W)


@triton.jit
def _multimem_st32(ptrs, bits):
    """multimem.st of 32-bit words at multicast ``ptrs`` (never executed on these machines).
    ptxas has no 16-bit multimem.st (.b16/.bf16/.f16 are rejected), so 16-bit outputs go in
    pairs of adjacent columns (checked by tests/test_compile_sm90.py, which assembles it)."""
    tl.inline_asm_elementwise(
        "multimem.st.relaxed.sys.global.b32 [$1], $2; mov.u32 $0, 0;",
        "=r,l,r", [ptrs, bits], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN: tl.constexpr, SHARD: tl.constexpr,
                W: tl.constexpr):
    """The epilogue's fp32 operands of an [M-tile, N-tile]: the reduced shared shard ``rs32``
    and this rank's prefix shard.  Loaded before the K loop (A wrote ``rs32`` before B's
    ``gdc_wait`` returned; ``prefix`` is an input), so their latency hides under the weights'."""
    sh = tl.load(rs32_ptr + offs_m[:, None] * SHARD + offs_n[None, :], mask=m2, other=0.0)
    col = shard_of(rank, HIDDEN, W)[0] + offs_n  # issue 20: b[rank] (= rank * SHARD when W divides H)
    pf = tl.load(prefix_ptr + offs_m[:, None] * HIDDEN + col[None, :], mask=m2, other=0.0).to(tl.float32)
    return sh, pf


@triton.jit
def _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                HIDDEN: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr, MB_BYTES: tl.constexpr,
                PAD_BYTES: tl.constexpr, DTYPE: tl.constexpr, MULTICAST: tl.constexpr):
    """``acc + sh + pf`` in fp32, one rounding, canonicalize, store into every rank's mailbox."""
    y = canonicalize(round_to(acc + sh + pf, DTYPE))   # the output's only rounding
    col = shard_of(rank, HIDDEN, W)[0] + offs_n  # issue 20: b[rank] (= rank * SHARD when W divides H)
    dst = offs_m[:, None] * HIDDEN + col[None, :]
    if MULTICAST:
        # One store reaches every rank's mailbox, two adjacent 16-bit columns per 32-bit word
        # (the host selects this only when the shard width is even, so a pair is all-valid or
        # all-masked and its element offset is even: 4-byte aligned).  Masked-off pairs are
        # redirected to the pad instead of predicating the instruction.
        BM: tl.constexpr = y.shape[0]
        BN: tl.constexpr = y.shape[1]
        tl.static_assert(BN % 2 == 0, "multicast stores need an even N tile")
        lo, hi = tl.split(tl.reshape(y.to(tl.uint16, bitcast=True), [BM, BN // 2, 2]))
        bits = (lo.to(tl.uint32) | (hi.to(tl.uint32) << 16)).to(tl.int32, bitcast=True)
        pmask, _unused = tl.split(tl.reshape(m2, [BM, BN // 2, 2]))
        pdst, _odd = tl.split(tl.reshape(dst, [BM, BN // 2, 2]))
        lane = tl.arange(0, BM)[:, None] * (BN // 2) + tl.arange(0, BN // 2)[None, :]
        base = tl.load(mc_ptr)
        addr = tl.where(pmask, base + MB_BYTES + pdst * 2, base + PAD_BYTES + (lane % 1024) * 4)  # pad: 4 KiB
        _multimem_st32(addr.to(tl.pointer_type(tl.int32)), bits)
    else:
        for d in tl.static_range(W):
            mb = (tl.load(table_ptr + d) + MB_BYTES).to(tl.pointer_type(DTYPE))
            tl.store(mb + dst, y, mask=m2)


@triton.jit(do_not_specialize=["rank", "M"])
def tail_b_kernel(
    normed_ptr, w_ptr, rs32_ptr, prefix_ptr, part_ptr, cnt_ptr,
    table_ptr, mc_ptr, ctrl_ptr, rank, M,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr,
    MB_BYTES: tl.constexpr, PAD_BYTES: tl.constexpr,
    BLOCK_M_: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    MULTICAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if USE_PDL:
        # A (the predecessor) is complete and its normed/rs32 scratch visible; also before
        # the first remote (mailbox) write.
        tl.extra.cuda.gdc_wait()
    DTYPE = normed_ptr.dtype.element_ty
    # Read now, used only to gate the stores: the weight stream does not wait for it.
    poisoned = is_poisoned(ctrl_ptr)
    nb = pid // SPLIT_K
    ks = pid % SPLIT_K
    K_TILES: tl.constexpr = (LATENT + BLOCK_K - 1) // BLOCK_K
    K_PER: tl.constexpr = ((K_TILES + SPLIT_K - 1) // SPLIT_K) * BLOCK_K
    offs_m = tl.arange(0, BLOCK_M_)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < SHARD
    m2 = mmask[:, None] & nmask[None, :]
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD, W)
    k0 = ks * K_PER
    a_ptrs = normed_ptr + offs_m[:, None] * LATENT + (k0 + offs_k)[None, :]
    b_ptrs = w_ptr + offs_n[None, :] * LATENT + (k0 + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M_, BLOCK_N], dtype=tl.float32)
    for kk in range(0, K_PER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = (k0 + kk + offs_k) < LATENT
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        if INTERPRET:
            # Triton 3.6's interpreter multiplies the raw uint16 bits of bf16 operands:
            # widen to fp32 first (exact; the products of 16-bit values are exact in fp32).
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not poisoned:  # a poisoned workspace gets no stores (partials, counter, mailboxes)
        if SPLIT_K == 1:
            _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                        HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)
        else:
            pp = part_ptr + (ks * BLOCK_M_ + offs_m[:, None]) * SHARD + offs_n[None, :]
            tl.store(pp, acc, mask=nmask[None, :])
            old = tl.atomic_add(cnt_ptr + nb, 1)  # acq_rel: the last arrival sees every partial
            if old == SPLIT_K - 1:
                tl.store(cnt_ptr + nb, 0)
                tot = tl.zeros([BLOCK_M_, BLOCK_N], dtype=tl.float32)
                for j in range(SPLIT_K):  # split order: deterministic
                    pj = part_ptr + (j * BLOCK_M_ + offs_m[:, None]) * SHARD + offs_n[None, :]
                    tot += tl.load(pj, mask=nmask[None, :], other=0.0, volatile=True)
                _b_epilogue(tot, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                            HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)


@triton.jit
def _gemv_a_row(normed_ptr, m: tl.constexpr, M, offs_k, kmask, LATENT: tl.constexpr, M_P2: tl.constexpr):
    """Row m of the A operand (``normed``), zeros past the M_P2 rows the kernel computes."""
    if m < M_P2:
        # block predicate, not a scalar one ANDed in (integer masks under the interpreter: numerics.finalize32)
        a = tl.load(normed_ptr + m * LATENT + offs_k, mask=kmask & (tl.broadcast_to(M, offs_k.shape) > m), other=0.0)
    else:
        a = tl.zeros(offs_k.shape, normed_ptr.dtype.element_ty)
    return a


@triton.jit(do_not_specialize=["rank", "M"])
def tail_b_gemv_kernel(
    normed_ptr, w_ptr, rs32_ptr, prefix_ptr,
    table_ptr, mc_ptr, ctrl_ptr, rank, M,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr,
    MB_BYTES: tl.constexpr, PAD_BYTES: tl.constexpr,
    ROWS: tl.constexpr, K_P2: tl.constexpr, M_P2: tl.constexpr, EVEN_N: tl.constexpr,
    MULTICAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Kernel B for M <= M_P2 <= 4 tokens: program p owns rows [p*ROWS, (p+1)*ROWS) of the
    shard and loads its whole [ROWS, LATENT] weight tile, the M rows of ``normed`` and the
    epilogue operands at once (every load in flight together); no tl.dot, no split-K.
    Same epilogue, same poison rule as ``tail_b_kernel``."""
    tl.static_assert(M_P2 <= 4)
    pid = tl.program_id(0)
    if USE_PDL:
        # As tail_b_kernel: before reading normed/rs32 (A's) and before any mailbox write.
        tl.extra.cuda.gdc_wait()
    DTYPE = normed_ptr.dtype.element_ty
    poisoned = is_poisoned(ctrl_ptr)  # gates only the stores
    offs_n = pid * ROWS + tl.arange(0, ROWS)
    offs_k = tl.arange(0, K_P2)
    offs_m = tl.arange(0, M_P2)
    nmask = offs_n < SHARD
    kmask = offs_k < LATENT
    mmask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None] * LATENT + offs_k[None, :]
    if EVEN_N and K_P2 == LATENT:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
    m2 = mmask[:, None] & nmask[None, :]
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD, W)
    # Scheduling fence (no data dependence; loads stay in flight across it): ptxas (sm_90,
    # Triton 3.6) sank most weight loads into the reduction at M = 1 (a few 16-byte loads
    # per thread in flight, the rest issued as partial sums consumed them).  No load
    # crosses a barrier and no arithmetic can start before the A rows loaded after it, so
    # every load above is issued first; the A rows (L2-resident, written by A) are all
    # loaded right after it, before the first row's reduction.
    tl.debug_barrier()
    a0 = _gemv_a_row(normed_ptr, 0, M, offs_k, kmask, LATENT, M_P2)
    a1 = _gemv_a_row(normed_ptr, 1, M, offs_k, kmask, LATENT, M_P2)
    a2 = _gemv_a_row(normed_ptr, 2, M, offs_k, kmask, LATENT, M_P2)
    a3 = _gemv_a_row(normed_ptr, 3, M, offs_k, kmask, LATENT, M_P2)
    acc = tl.zeros([M_P2, ROWS], dtype=tl.float32)
    for m in tl.static_range(M_P2):
        if m == 0:
            a = a0
        elif m == 1:
            a = a1
        elif m == 2:
            a = a2
        else:
            a = a3
        # fp32 products (exact for 16-bit inputs) and fp32 sums; widened before the
        # multiply (the interpreter mishandles 16-bit arithmetic)
        r = tl.sum(w.to(tl.float32) * a[None, :].to(tl.float32), axis=1)
        acc = tl.where(offs_m[:, None] == m, r[None, :], acc)
    if not poisoned:  # a poisoned workspace gets no stores into any mailbox
        _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                    HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)
