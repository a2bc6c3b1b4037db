"""TAIL_FUSION kernel B: the sharded skinny up-projection with the fused epilogue (DESIGN §3.2).

Part of the three-kernel decode tail A -> B -> C of ``triton_kernels/tail_fusion.py``: the
buffers, A, C and the proof that one stage of slots suffices are there; this file holds B.
B's part of the protocol:

(B) ``tail_b_kernel``: ``acc[M, S-tile] = normed[0:M, :] @ W_up_shard[n-block, :]^T`` with the
    projection GEMM family's reduction tree (``gemm.chunk_ptr`` / ``gemm.chunk_tma`` around
    ``gemm.mma_chunk``, ``gemm.k_loop_*`` for the whole tree): the same code as ``k3tail.project``
    and every other tier's projection, so the same arithmetic -- K cut into
    ``TREE_S = gemm.tree_chunks(LATENT)`` chunks, each chunk an fp32 chain of one tensor-core
    ``tl.dot`` per BLOCK_K = 64 tile from zero, the chunk partials added in chunk order
    (``gemm.py`` states the batch invariance this buys and what keeps it; ``K_UNROLL`` only unrolls
    a chunk's loop).  Grid ``(cdiv(S, BLOCK_N), B_SPLIT)``: ``B_SPLIT`` programs share one N tile's
    chunks (the tactic ``b_split``, a power of two dividing TREE_S: more programs in flight at
    decode, never another tree).  Every output element is stored by one program.
    SWAP_AB puts the weights on the MMA's M side (tokens on its N side: 16 = the tail's
    capacity); USE_TMA reads ``normed`` and the weight shard through host TMA descriptors
    (``normed_desc`` of ``normed[0:M]`` with box [16, 64], ``w_desc`` of the shard with box
    [BLOCK_N, 64]; rows past M / S read zeros), else through pointers (rows past M / S are
    clamped to row 0 for the loads and never stored).  Right after ``gdc_wait`` every program
    reads the poison flag and loads its epilogue operands (``rs32`` tile and prefix shard tile,
    fp32), then streams the weights at once: the flag only gates the stores, the operands are
    not a second round trip after the K loop.
    ``B_SPLIT = 1``: the program forms the whole tree in registers.  ``B_SPLIT > 1``: program
    (n, k) stores each of its chunks' fp32 partials whole into its own tile of this rank's local
    ``part`` scratch (``[n tiles, TREE_S, 16 * BLOCK_N]``, nobody else writes it), then a CTA
    barrier and one gpu-scope acq_rel ``atomic_add`` on the tile's counter ``cnt[n]`` (local);
    the program that draws ticket ``B_SPLIT - 1`` is the last: the release of every other
    program's ticket published its partials, its own acquire makes them visible; it re-arms
    ``cnt[n] = 0``, loads the TREE_S partials (``.cg``: from L2, never a stale L1 line) and adds
    them in chunk order -- the same fp32 additions ``k_loop_*`` makes -- and runs the epilogue.
    The counter is 0 at every launch start: a launch takes exactly ``B_SPLIT`` tickets per tile
    and its last program re-arms it; the next B on the same set starts after this one completed
    (stream order; with PDL, B's ``gdc_wait`` waits on A, whose ``gdc_wait`` waited on the C that
    waited on this B's stores); the recovery zeroes it too.  The decision is one per program
    (``lamport.cta_any``).  No program waits.
    Epilogue: ``(prefix shard + acc) + rs32`` in fp32 (``gemm.combine``: the family's order,
    so a token's output bits do not depend on the tier), ONE rounding (``round_to``),
    canonicalize, store into columns [rank*S, ...) of EVERY rank's mailbox (unicast stores
    through the peer table).  A multicast-store variant (``MULTICAST``, chosen only when the
    workspace reports a multicast address, the shard width is even and the N tile is even:
    never on this project's machines; CI assembles it for sm_90, nothing runs it) stores once
    through the multicast address with ``multimem.st.b32``, two adjacent 16-bit columns per
    word (ptxas has no 16-bit multimem.st; masked-off pairs are redirected to the pad instead
    of predicating the instruction, which ptxas is reported to mishandle).  B never waits; on a
    poisoned workspace it stores nothing into any mailbox (it still takes its tickets, so the
    counters stay armed).

(B') ``tail_b_gemv_kernel``, the decode GEMV: only where the vote agreed ``batch_invariant`` off
    (the default) and M <= tactic ``b_gemv_max_m`` (<= 4).  Grid ``(cdiv(S, ROWS),)``: program p
    owns shard rows ``[p*ROWS, (p+1)*ROWS)``, loads its whole weight tile and the M rows of
    ``normed`` at once and sums each row over K in one fp32 ``tl.sum`` of exact fp32 products:
    not the family's tree, so its bits differ from every other tier's and from B at M > b_gemv_max_m
    (the cost of the switch, DESIGN §10).  It touches no scratch and no counter; otherwise B's
    protocol exactly: ``gdc_wait`` first, the poison flag gates the stores, the same epilogue into
    the same mailbox columns, no wait.

What the chain argument of ``tail_fusion.py`` needs from B (either kernel): B never waits (no peer memory is
polled); every B program calls ``gdc_wait`` (PDL) before it reads A's local scratch
(``normed``, ``rs32``) and before its first remote (mailbox) store, so "B(n) started" implies
"A(n) complete, re-arms included"; B writes only columns ``[rank*S, (rank+1)*S)`` of every
rank d's mailbox, which d's C re-arms after reading them; on a poisoned workspace it stores nothing.
"""

import triton
import triton.language as tl

from .gemm import BLOCK_K, chunk_ptr, chunk_tma, combine, k_loop_ptr, k_loop_tma
from .lamport import canonicalize, cta_any, is_poisoned, round_to, shard_of


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


@triton.jit
def _b_chunk(normed_ptr, w_ptr, normed_desc, w_desc, pid_n, rm_ld, rn_ld, kt0, LATENT: tl.constexpr,
             CH: tl.constexpr, BLOCK_M_: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
             USE_TMA: tl.constexpr, K_UNROLL: tl.constexpr):
    """One chunk of the tree (tiles ``kt0 .. kt0 + CH - 1``), from zero: ``gemm.chunk_*``."""
    if USE_TMA:
        part = chunk_tma(normed_desc, w_desc, 0, pid_n * BLOCK_N, kt0, CH, BLOCK_M_, BLOCK_N, SWAP_AB, K_UNROLL)
    else:
        part = chunk_ptr(normed_ptr, w_ptr, rm_ld, rn_ld, LATENT, 1, LATENT, 1, kt0, LATENT, CH, BLOCK_M_,
                         BLOCK_N, SWAP_AB, K_UNROLL)
    return part


@triton.jit(do_not_specialize=["rank", "M"])
def tail_b_kernel(
    normed_ptr, w_ptr, rs32_ptr, prefix_ptr, normed_desc, w_desc,
    table_ptr, mc_ptr, ctrl_ptr, part_ptr, cnt_ptr, rank, M,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr,
    MB_BYTES: tl.constexpr, PAD_BYTES: tl.constexpr,
    BLOCK_M_: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, USE_TMA: tl.constexpr,
    K_UNROLL: tl.constexpr, TREE_S: tl.constexpr, B_SPLIT: tl.constexpr, MULTICAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    if USE_PDL:
        # A (the predecessor) is complete and its normed/rs32 scratch visible; also before
        # the first remote (mailbox) write.
        tl.extra.cuda.gdc_wait()
    DTYPE = normed_ptr.dtype.element_ty
    # Read now, used only to gate the stores: the weight stream does not wait for it.
    poisoned = is_poisoned(ctrl_ptr)
    offs_m = tl.arange(0, BLOCK_M_)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < SHARD
    m2 = mmask[:, None] & nmask[None, :]
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD, W)
    rm_ld = tl.where(mmask, offs_m, 0).to(tl.int64)   # rows past M / S: row 0, never stored
    rn_ld = tl.where(nmask, offs_n, 0).to(tl.int64)
    # the projection family's tree (gemm.py): same chunks, same order, same MMA as every tier
    if B_SPLIT == 1:
        if USE_TMA:
            acc = k_loop_tma(normed_desc, w_desc, 0, pid_n * BLOCK_N, LATENT, TREE_S, BLOCK_M_, BLOCK_N, SWAP_AB,
                             K_UNROLL, False)
        else:
            acc = k_loop_ptr(normed_ptr, w_ptr, rm_ld, rn_ld, LATENT, 1, LATENT, 1, LATENT, TREE_S, BLOCK_M_,
                             BLOCK_N, SWAP_AB, K_UNROLL, False)
        if SWAP_AB:
            acc = tl.trans(acc)   # [BLOCK_N, BLOCK_M_] -> [BLOCK_M_, BLOCK_N]
        if not poisoned:  # a poisoned workspace gets no stores into any mailbox
            _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                        HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)
    else:
        # Split over programs: program (pid_n, pid_k) computes chunks pid_k * CPP .. + CPP - 1, each
        # from zero, and stores each partial whole (fp32, MMA orientation) into its own tile of the
        # local ``part`` scratch; the program that takes the last ticket of this N tile adds all
        # TREE_S partials in chunk order -- the sum k_loop_* forms in registers -- and runs the epilogue.
        K_TILES: tl.constexpr = (LATENT + BLOCK_K - 1) // BLOCK_K
        CH: tl.constexpr = K_TILES // TREE_S
        CPP: tl.constexpr = TREE_S // B_SPLIT
        tl.static_assert(CH * TREE_S == K_TILES, "TREE_S must divide the K tiles (gemm.tree_chunks)")
        tl.static_assert(CPP * B_SPLIT == TREE_S, "b_split must divide the tree's chunk count")
        TILE: tl.constexpr = BLOCK_M_ * BLOCK_N
        if SWAP_AB:
            r_io = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M_ + tl.arange(0, BLOCK_M_)[None, :]
        else:
            r_io = tl.arange(0, BLOCK_M_)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tiles = part_ptr + pid_n.to(tl.int64) * (TREE_S * TILE)
        pid_k = tl.program_id(1)
        for c in tl.static_range(CPP):
            s = pid_k * CPP + c
            part = _b_chunk(normed_ptr, w_ptr, normed_desc, w_desc, pid_n, rm_ld, rn_ld, s * CH, LATENT, CH,
                            BLOCK_M_, BLOCK_N, SWAP_AB, USE_TMA, K_UNROLL)
            tl.store(tiles + s * TILE + r_io, part)
        # every thread's partial stores come before the ticket (CTA barrier, then a gpu-scope
        # acq_rel atomic: the release publishes them; the last program's acquire sees them all)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        # The program with the last ticket (B_SPLIT - 1) re-arms the counter to 0 for the next
        # launch: every ticket of this launch is taken by then, and the next B on this set starts
        # only after this one completed (stream order; with PDL its gdc_wait waits on A, which
        # waited on the C that waited on this B's stores).  One decision per program
        # (lamport.cta_any), the same in every warp.
        if cta_any(ticket == B_SPLIT - 1):
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            acc = tl.load(tiles + r_io, cache_modifier=".cg")
            for s2 in range(1, TREE_S):  # the partials in chunk order, as k_loop_* adds them
                acc = acc + tl.load(tiles + s2 * TILE + r_io, cache_modifier=".cg")
            if SWAP_AB:
                acc = tl.trans(acc)
            if not poisoned:
                _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                            HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)


@triton.jit
def _gemv_a_row(normed_ptr, m: tl.constexpr, M, offs_k, kmask, LATENT: tl.constexpr, M_P2: tl.constexpr):
    """Row m of the A operand (``normed``); zeros for rows past M or past the M_P2 rows computed."""
    if m < M_P2:
        a = tl.load(normed_ptr + m * LATENT + offs_k, mask=kmask & ((offs_k * 0 + m) < M), other=0.0)
    else:
        a = tl.zeros(offs_k.shape, normed_ptr.dtype.element_ty)
    return a


@triton.jit(do_not_specialize=["rank", "M"])
def tail_b_gemv_kernel(
    normed_ptr, w_ptr, rs32_ptr, prefix_ptr, table_ptr, mc_ptr, ctrl_ptr, rank, M,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr,
    MB_BYTES: tl.constexpr, PAD_BYTES: tl.constexpr,
    ROWS: tl.constexpr, K_P2: tl.constexpr, M_P2: tl.constexpr, EVEN_N: tl.constexpr,
    MULTICAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Kernel B's decode GEMV (``batch_invariant`` off, M <= M_P2 <= 4): program p owns shard rows
    ``[p*ROWS, (p+1)*ROWS)`` and loads its whole ``[ROWS, LATENT]`` weight tile (K padded to K_P2,
    masked), the epilogue operands and the M rows of ``normed`` at once; each token's row is
    ``sum_k w * a`` with fp32 products (exact for 16-bit inputs) and one fp32 ``tl.sum`` over K (not
    the projection family's tree: other bits, so a token's bits here depend on M).  No ``tl.dot``, no
    split, no scratch, no counter.  Same protocol as ``tail_b_kernel`` otherwise: ``gdc_wait`` before
    the first read of A's scratch and the first mailbox store, the poison flag gates the stores only,
    the same epilogue and mailbox columns, never a wait."""
    tl.static_assert(M_P2 <= 4)
    pid = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()   # A complete, its normed/rs32 visible; before any mailbox store
    DTYPE = normed_ptr.dtype.element_ty
    poisoned = is_poisoned(ctrl_ptr)  # gates only the stores
    offs_n = pid * ROWS + tl.arange(0, ROWS)
    offs_k = tl.arange(0, K_P2)
    offs_m = tl.arange(0, M_P2)
    nmask = offs_n < SHARD
    kmask = offs_k < LATENT
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * LATENT + offs_k[None, :]
    if EVEN_N and K_P2 == LATENT:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
    m2 = (offs_m < M)[:, None] & nmask[None, :]
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD, W)
    # Scheduling fence (no data dependence; loads stay in flight across it): ptxas (sm_90, Triton
    # 3.6) sank most weight loads into the reduction at M = 1 (a few 16-byte loads per thread in
    # flight, the rest issued as the partial sums consumed them).  No arithmetic can start before the
    # A rows loaded after the barrier, so every load above is issued first.
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
        # fp32 products (exact for 16-bit inputs), fp32 sums; widened before the multiply (the
        # interpreter mishandles 16-bit arithmetic)
        r = tl.sum(w.to(tl.float32) * a[None, :].to(tl.float32), axis=1)
        acc = tl.where(offs_m[:, None] == m, r[None, :], acc)
    if not poisoned:  # a poisoned workspace gets no stores into any mailbox
        _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                    HIDDEN, SHARD, W, MB_BYTES, PAD_BYTES, DTYPE, MULTICAST)
