"""TAIL_FUSION kernel B: the sharded skinny up-projection with the fused epilogue (DESIGN §3.2).

Part of the three-kernel decode tail A -> B -> C of ``triton_kernels/tail_fusion.py``: the
buffers, A, C and the proof that one stage of slots suffices are there; this file holds B.
B's part of the protocol:

(B) ``tail_b_kernel``: ``acc[M, S-tile] = normed[0:M, :] @ W_up_shard[n-block, :]^T`` with the
    projection GEMM family's K loop (``gemm.k_loop_ptr`` / ``gemm.k_loop_tma`` around
    ``gemm.mma_chunk``): the same code as ``k3tail.project`` and every other tier's projection,
    so the same arithmetic -- fp32 accumulator, BLOCK_K = 64 chunks in ascending order, one
    tensor-core ``tl.dot`` per chunk, no split-K, no GEMV (``gemm.py`` states the batch
    invariance this buys and what keeps it; ``K_UNROLL`` only unrolls that loop, chunk order and
    dots unchanged).  Grid: one program per BLOCK_N columns of the
    shard (``cdiv(S, BLOCK_N)``); every output element is computed and stored by one program.
    SWAP_AB puts the weights on the MMA's M side (tokens on its N side: 16 = the tail's
    capacity); USE_TMA reads ``normed`` and the weight shard through host TMA descriptors
    (``normed_desc`` of ``normed[0:M]`` with box [16, 64], ``w_desc`` of the shard with box
    [BLOCK_N, 64]; rows past M / S read zeros), else through pointers (rows past M / S are
    clamped to row 0 for the loads and never stored).  Right after ``gdc_wait`` every program
    reads the poison flag and loads its epilogue operands (``rs32`` tile and prefix shard tile,
    fp32), then streams the weights at once: the flag only gates the stores, the operands are
    not a second round trip after the K loop.
    Epilogue: ``(prefix shard + acc) + rs32`` in fp32 (``gemm.combine``: the family's order,
    so a token's output bits do not depend on the tier), ONE rounding (``round_to``),
    canonicalize, store into columns [rank*S, ...) of EVERY rank's mailbox (unicast stores
    through the peer table).  A multicast-store variant (``MULTICAST``, chosen only when the
    workspace reports a multicast address, the shard width is even and the N tile is even:
    never on this project's machines; CI assembles it for sm_90, nothing runs it) stores once
    through the multicast address with ``multimem.st.b32``, two adjacent 16-bit columns per
    word (ptxas has no 16-bit multimem.st; masked-off pairs are redirected to the pad instead
    of predicating the instruction, which ptxas is reported to mishandle).  B never waits; on a
    poisoned workspace it stores nothing (nothing into any mailbox).  No atomics, no counters,
    no partials.

What the chain argument of ``tail_fusion.py`` needs from B: B never waits (no peer memory is
polled); every B program calls ``gdc_wait`` (PDL) before it reads A's local scratch
(``normed``, ``rs32``) and before its first remote (mailbox) store, so "B(n) started" implies
"A(n) complete, re-arms included"; B writes only columns ``[rank*S, (rank+1)*S)`` of every
rank d's mailbox, which d's C re-arms after reading them; on a poisoned workspace it stores nothing.
"""

import triton
import triton.language as tl

from .gemm import combine, k_loop_ptr, k_loop_tma
from .lamport import canonicalize, is_poisoned, round_to, shard_of


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
    col = shard_of(rank, HIDDEN, W)[0] + offs_n  # b[rank] (= rank * SHARD when W divides H)
    pf = tl.load(prefix_ptr + offs_m[:, None] * HIDDEN + col[None, :], mask=m2, other=0.0).to(tl.float32)
    return sh, pf


@triton.jit
def _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                HIDDEN: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr, MB_BYTES: tl.constexpr,
                PAD_BYTES: tl.constexpr, DTYPE: tl.constexpr, MULTICAST: tl.constexpr):
    """``(pf + acc) + sh`` in fp32 (the family's epilogue order), one rounding, canonicalize,
    store into every rank's mailbox."""
    y = canonicalize(round_to(combine(acc, pf, sh, True, True), DTYPE))   # the output's only rounding
    col = shard_of(rank, HIDDEN, W)[0] + offs_n  # b[rank]: uneven shards where W does not divide H
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
    normed_ptr, w_ptr, rs32_ptr, prefix_ptr, normed_desc, w_desc,
    table_ptr, mc_ptr, ctrl_ptr, rank, M,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr,
    MB_BYTES: tl.constexpr, PAD_BYTES: tl.constexpr,
    BLOCK_M_: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
    K_UNROLL: tl.constexpr, MULTICAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if USE_PDL:
        # A (the predecessor) is complete and its normed/rs32 scratch visible; also before
        # the first remote (mailbox) write.
        tl.extra.cuda.gdc_wait()
    DTYPE = normed_ptr.dtype.element_ty
    # Read now, used only to gate the stores: the weight stream does not wait for it.
    poisoned = is_poisoned(ctrl_ptr)
    offs_m = tl.arange(0, BLOCK_M_)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < SHARD
    m2 = mmask[:, None] & nmask[None, :]
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD, W)
    # the projection family's K loop (gemm.py): same chunks, same order, same MMA as every tier
    if USE_TMA:
        acc = k_loop_tma(normed_desc, w_desc, 0, pid * BLOCK_N, LATENT, BLOCK_M_, BLOCK_N, SWAP_AB, K_UNROLL)
    else:
        rm_ld = tl.where(mmask, offs_m, 0).to(tl.int64)   # rows past M / S: row 0, never stored
        rn_ld = tl.where(nmask, offs_n, 0).to(tl.int64)
        acc = k_loop_ptr(normed_ptr, w_ptr, rm_ld, rn_ld, LATENT, 1, LATENT, 1, LATENT, BLOCK_M_, BLOCK_N,
                         SWAP_AB, K_UNROLL)
    if SWAP_AB:
        acc = tl.trans(acc)   # [BLOCK_N, BLOCK_M_] -> [BLOCK_M_, BLOCK_N]
    if not poisoned:  # a poisoned workspace gets no stores into any mailbox
        _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                    HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)
