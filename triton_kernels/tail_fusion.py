"""TAIL_FUSION: the three-kernel decode tail (DESIGN §3.2), M <= 16 tokens.

    out[M,H] = prefix + RMSNorm_gamma(sum_r routed_r) @ W_up^T + sum_r shared_r

Buffers
=======
One *workspace set* per rank (symmetric: same byte layout on every rank, reached through
the int64 peer table ``table[d]``), ``S = H / W`` (the column shard a rank owns)::

    offset 0        routed  fp32  [MAX_TOKENS][W][L]   slot (t, src): src's routed row t
    RS_BYTES        rs      dtype [MAX_TOKENS][W][S]   slot (t, src): src's shared[t, my shard]
    MB_BYTES        mailbox dtype [MAX_TOKENS][H]      columns [src*S, (src+1)*S): src's finished shard
    PAD_BYTES       pad     4 KiB (multicast variant only: target of masked-off lanes)

``routed`` slots are fp32 (32-bit -0.0 sentinel; the host passes their byte range as
``arm32``): a finalize result or ``routed * scale`` is a partial sum that the rounding
contract forbids rounding to 16 bits before the cross-rank sum.  ``rs`` carries the shared
partial unchanged (an exact 16-bit input), ``mailbox`` the once-rounded output.

Local (never addressed by peers) scratch of the set: ``sum32 [MT, L]`` fp32 (the reduced
latent), ``sq [MT, SLICES]`` fp64 (partial sums of squares), ``normed [MT, L]`` dtype (the
once-rounded normed latent, kernel B's A operand), ``rs32 [MT, S]`` fp32 (the reduced own
shared shard, handed to B in fp32), ``cnt_a [MT]`` and ``cnt_b [..]`` int32 arrival
counters (each reset to 0 by the program that completes it), ``part [SPLIT_K, 16, S]``
fp32 (split-K partials of B).

Kernels (all on the rank's stream, in the order A, B, C)
========================================================
(A) ``tail_a_kernel``: work item (token t, slice s), s < SLICES; item i is handled by
    program i % P on every rank (persistent grid-stride loop, grid capped to stay
    co-resident).  It computes this rank's routed row, columns of slice s, in fp32
    (``numerics.py``: exact products, so the bits do not depend on FMA contraction;
    finalize ``scale * sum_{k ascending} w[t,k] * expert_out[idx[t,k]]``, or
    ``scale * routed[t]``), canonicalizes -0.0 and stores it into routed slot (t, rank)
    of EVERY rank; it stores slice s of column shard d of ``shared[t]`` into rs slot
    (t, rank) of rank d, for every d.  Then it polls its LOCAL routed slots (t, 0..W-1)
    of slice s, sums them in rank order in fp64 and rounds once into ``sum32`` (and the
    slice's fp64 sum of squares into ``sq``), re-arms them; polls its local rs slots
    (t, 0..W-1) of slice s, sums them the same way into ``rs32``, re-arms them.  The program that completes
    token t (arrival counter ``cnt_a[t]``, acq_rel atomic) adds the SLICES partial sums
    of squares in slice order, ``rstd = numerics.rms_rstd(ss)`` (the statistic every tier
    uses, so all tiers round the latent to the same bits) and writes
    ``normed[t] = round_to(sum32[t] * rstd * gamma)`` (the latent's only rounding).
    Interpreter-safe: program p only waits for data that the peers' program p publishes
    (same item order on every rank) before it waits; counters never wait.
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
(C) ``tail_c_kernel``: work items (t, column chunk), small persistent grid: poll the local
    mailbox until the chunk holds no sentinel, copy it to ``out``, re-arm it.

Who re-arms what: every slot is re-armed by its only reader (consumer-side): A re-arms
the routed and rs slots it read, C the mailbox chunks it read.

Why one stage suffices (the cross-rank chain A -> B -> C -> next A)
====================================================================
Let n be a call and r, d two ranks (r == d included).  Every kernel completes only after
its predecessor on the same rank completed: plain stream order, or, with PDL, because
each kernel calls ``gdc_wait`` (wait for the predecessor's completion and memory flush)
before its first remote write AND before touching the local scratch its predecessor
uses; no kernel triggers its dependents early (``gdc_launch_dependents`` is never called,
so a waiting dependent never occupies SMs a spinning peer grid needs in loopback).

* routed / rs slot (t, r) on rank d is written by r's A(n+1) and re-armed by d's A(n).
  r's A(n+1) runs after r's C(n) completed; r's C(n) completed only after it saw d's
  B(n) shard in its mailbox; d's B(n) started after d's A(n) completed, re-arm included.
  So d's re-arm happens-before r's next write.
* mailbox columns of r on rank d are written by r's B(n+1) and re-armed by d's C(n).
  r's B(n+1) starts after r's A(n+1) completed; r's A(n+1) completed only after it saw
  d's routed slice of call n+1, which d's A(n+1) published after d's C(n) completed,
  re-arm included.
* local scratch (sum32, sq, normed, rs32, counters, part): A(n+1) writes it only after C(n)
  completed, and C(n) completed after B(n) (its gdc_wait / stream order), the last reader.
Hence a single slot set per workspace; the set can be shared by several layers (their
calls are stream-ordered and each call is a complete chain), which is what the pool does.

Why the pool (DESIGN §3.1): the chain above assumes the kernel in front of A(n+1) waited
for C(n).  Between two layers another library's kernel launched with PDL may not call
``gdc_wait``; then A of the next layer is only ordered after that kernel, not after this
layer's C (whose re-arms may not be flushed yet).  So consecutive layers use different
workspace sets (pool keyed by layer, depth >= 2); a set is reused only after a full
TAIL_FUSION chain of another set ran in between.

Bounded waits (A, C): ``wait_ready`` with a deadline; on timeout the workspace is poisoned
and every later wait/launch exits at once; B still streams its weights (the flag gates
only its stores) but stores nothing (nothing into any mailbox) on a poisoned workspace.
The host raises ``PeerTimeout`` / ``WorkspacePoisoned``.
"""

import triton
import triton.language as tl

from .lamport import (_INTERPRET, canonicalize, is_poisoned, now_ns, rearm, round_to, wait_ready)
from .numerics import finalize32, rank_sum64, rms_rstd, sq64

BLOCK_M = 16        # M padded to 16 for tl.dot (TAIL_FUSION capacity is 16 tokens)
PAD_BYTES_SIZE = 4096


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns"])
def tail_a_kernel(
    routed_ptr, eo_ptr, ew_ptr, idx_ptr, shared_ptr, gamma_ptr,
    normed_ptr, sum_ptr, sq_ptr, rs32_ptr, cnt_ptr,
    table_ptr, ctrl_ptr, host_flag_ptr, clock_ptr,
    rank, M, timeout_ns, routed_scale, eps,
    HIDDEN: tl.constexpr, LATENT: tl.constexpr, SHARD: tl.constexpr, TOPK: tl.constexpr,
    W: tl.constexpr, W_P2: tl.constexpr, SLICES: tl.constexpr, SQ_STRIDE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, RS_BYTES: tl.constexpr,
    DEFERRED: tl.constexpr, USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if USE_PDL:
        # Before the first remote write and before touching the scratch B(n-1) read:
        # the predecessor (C of the previous call on this set, or any earlier kernel) is done.
        tl.extra.cuda.gdc_wait()
    deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
    DTYPE = shared_ptr.dtype.element_ty
    my_addr = tl.load(table_ptr + rank)
    my_routed = my_addr.to(tl.pointer_type(tl.float32))
    my_rs = (my_addr + RS_BYTES).to(tl.pointer_type(DTYPE))
    srcs = tl.arange(0, W_P2)
    offs_l = tl.arange(0, BLOCK_L)
    offs_s = tl.arange(0, BLOCK_S)
    n_items = M * SLICES
    if not is_poisoned(ctrl_ptr):
        item = pid
        while item < n_items:
            t = item // SLICES
            s = item % SLICES
            col = s * BLOCK_L + offs_l
            lmask = col < LATENT
            # ---- this rank's routed row (slice s), fp32, published to every rank
            if DEFERRED:
                x = finalize32(t.to(tl.int64), col, lmask, eo_ptr, ew_ptr, idx_ptr, LATENT, TOPK)
            else:
                x = tl.load(routed_ptr + t * LATENT + col, mask=lmask, other=0.0).to(tl.float32)
            x = canonicalize(x * routed_scale)
            slot = (t * W + rank) * LATENT + col
            for d in tl.static_range(W):
                peer = tl.load(table_ptr + d).to(tl.pointer_type(tl.float32))
                tl.store(peer + slot, x, mask=lmask)
            # ---- slice s of column shard d of shared[t] -> rs slot (t, rank) of rank d
            cs = s * BLOCK_S + offs_s
            smask = cs < SHARD
            for d in tl.static_range(W):
                v = canonicalize(tl.load(shared_ptr + t * HIDDEN + d * SHARD + cs, mask=smask, other=0.0))
                peer_rs = (tl.load(table_ptr + d) + RS_BYTES).to(tl.pointer_type(DTYPE))
                tl.store(peer_rs + (t * W + rank) * SHARD + cs, v, mask=smask)
            # ---- poll local routed slots (t, 0..W-1), rank-order fp64 sum -> fp32, re-arm
            rrows = (t * W + srcs[:, None]) * LATENT + col[None, :]
            rmask = (srcs[:, None] < W) & lmask[None, :]
            ok = wait_ready(my_routed + rrows, rmask, ctrl_ptr, host_flag_ptr, clock_ptr,
                            deadline, USE_GLOBALTIMER)
            if ok:
                acc = rank_sum64(my_routed + t * W * LATENT + col, LATENT, lmask, W).to(tl.float32)
                tl.store(sum_ptr + t * LATENT + col, acc, mask=lmask)
                tl.store(sq_ptr + t * SQ_STRIDE + s, tl.sum(sq64(acc)))  # fp64 statistic
                rearm(my_routed + rrows, rmask, tl.float32)  # barrier first (lamport.py)
                # ---- poll local rs slots (t, 0..W-1), own shard slice, fp32 sum, re-arm
                srows = (t * W + srcs[:, None]) * SHARD + cs[None, :]
                sm2 = (srcs[:, None] < W) & smask[None, :]
                ok2 = wait_ready(my_rs + srows, sm2, ctrl_ptr, host_flag_ptr, clock_ptr,
                                 deadline, USE_GLOBALTIMER)
                if ok2:
                    sacc = rank_sum64(my_rs + t * W * SHARD + cs, SHARD, smask, W)
                    tl.store(rs32_ptr + t * SHARD + cs, sacc.to(tl.float32), mask=smask)
                    rearm(my_rs + srows, sm2, DTYPE)
                    # ---- the program completing token t normalizes the row
                    old = tl.atomic_add(cnt_ptr + t, 1)  # acq_rel: sees the others' sum32/sq
                    if old == SLICES - 1:
                        tl.store(cnt_ptr + t, 0)
                        ss = tl.load(sq_ptr + t * SQ_STRIDE, volatile=True)
                        for j in range(1, SLICES):  # slice order: deterministic
                            ss += tl.load(sq_ptr + t * SQ_STRIDE + j, volatile=True)
                        # the shared statistic (numerics.py): every tier rounds the latent alike
                        rstd = rms_rstd(ss, LATENT, eps)
                        for j in range(SLICES):
                            cj = j * BLOCK_L + offs_l
                            mj = cj < LATENT
                            xs = tl.load(sum_ptr + t * LATENT + cj, mask=mj, other=0.0, volatile=True)
                            g = tl.load(gamma_ptr + cj, mask=mj, other=0.0).to(tl.float32)
                            tl.store(normed_ptr + t * LATENT + cj, round_to(xs * rstd * g, DTYPE), mask=mj)
            item += nprog


@triton.jit
def _multimem_st32(ptrs, bits):
    """multimem.st of 32-bit words at multicast ``ptrs`` (never executed on these machines).
    ptxas has no 16-bit multimem.st (.b16/.bf16/.f16 are rejected), so 16-bit outputs go in
    pairs of adjacent columns (checked by tests/test_compile_sm90.py, which assembles it)."""
    tl.inline_asm_elementwise(
        "multimem.st.relaxed.sys.global.b32 [$1], $2; mov.u32 $0, 0;",
        "=r,l,r", [ptrs, bits], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN: tl.constexpr, SHARD: tl.constexpr):
    """The epilogue's fp32 operands of an [M-tile, N-tile]: the reduced shared shard ``rs32``
    and this rank's prefix shard.  Loaded before the K loop (A wrote ``rs32`` before B's
    ``gdc_wait`` returned; ``prefix`` is an input), so their latency hides under the weights'."""
    sh = tl.load(rs32_ptr + offs_m[:, None] * SHARD + offs_n[None, :], mask=m2, other=0.0)
    col = rank * SHARD + offs_n
    pf = tl.load(prefix_ptr + offs_m[:, None] * HIDDEN + col[None, :], mask=m2, other=0.0).to(tl.float32)
    return sh, pf


@triton.jit
def _b_epilogue(acc, sh, pf, offs_m, offs_n, m2, table_ptr, mc_ptr, rank,
                HIDDEN: tl.constexpr, SHARD: tl.constexpr, W: tl.constexpr, MB_BYTES: tl.constexpr,
                PAD_BYTES: tl.constexpr, DTYPE: tl.constexpr, MULTICAST: tl.constexpr):
    """``acc + sh + pf`` in fp32, one rounding, canonicalize, store into every rank's mailbox."""
    y = canonicalize(round_to(acc + sh + pf, DTYPE))   # the output's only rounding
    col = rank * SHARD + offs_n
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
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD)
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
        if _INTERPRET:
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
    sh, pf = _b_operands(rs32_ptr, prefix_ptr, offs_m, offs_n, m2, rank, HIDDEN, SHARD)
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


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns"])
def tail_c_kernel(
    out_ptr, table_ptr, ctrl_ptr, host_flag_ptr, clock_ptr, rank, M, timeout_ns,
    HIDDEN: tl.constexpr, MB_BYTES: tl.constexpr, BLOCK: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if USE_PDL:
        # Not needed for C's own data (it polls), but it makes "C(n) complete" imply
        # "B(n) complete" on this rank, which the chain argument uses for the scratch.
        tl.extra.cuda.gdc_wait()
    deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
    DTYPE = out_ptr.dtype.element_ty
    mb = (tl.load(table_ptr + rank) + MB_BYTES).to(tl.pointer_type(DTYPE))
    CHUNKS: tl.constexpr = (HIDDEN + BLOCK - 1) // BLOCK
    offs = tl.arange(0, BLOCK)
    n_items = M * CHUNKS
    if not is_poisoned(ctrl_ptr):
        item = pid
        while item < n_items:
            t = item // CHUNKS
            col = (item % CHUNKS) * BLOCK + offs
            cmask = col < HIDDEN
            ptrs = mb + t * HIDDEN + col
            ok = wait_ready(ptrs, cmask, ctrl_ptr, host_flag_ptr, clock_ptr, deadline, USE_GLOBALTIMER)
            if ok:
                v = tl.load(ptrs, mask=cmask, other=0.0, volatile=True)
                tl.store(out_ptr + t * HIDDEN + col, v, mask=cmask)
                rearm(ptrs, cmask, DTYPE)
            item += nprog
