"""Fused MoE finalize + one-shot Lamport all-reduce + RMSNorm, in one launch.

One kernel serves two ops (``k3tail/finalize.py``):

* ``FinalizeAllReduceRMSNorm`` (DESIGN §3.3): per rank ``r = scale * (routed | finalize(triple))
  (+ shared)``, ``s = sum_ranks r (+ residual)``, outputs ``RMSNorm(s) * gamma`` (and
  ``residual_out = s``).
* ``LaneAllReduce`` (the FUSED_LANE_AR tier, DESIGN §2): the lane ``[routed L | shared H]``
  is all-reduced; the routed sum is RMS-normalized in the epilogue, the shared sum is written
  in fp32 (the projection rounds once).

Buffers (per rank, identical layout; ``lamport.py`` states the slot protocol)::

    R32  slots32[stage][src][token][WIDTH]        fp32, NUM_STAGES x W x MAX_TOKENS x WIDTH
    R16  slots16[stage][src][token][WIDTH + SH]   16-bit, right after R32 (byte offset OFF16)
    scratch[token][WIDTH]                         fp32, local to the rank (not symmetric)

R32 is armed with the 32-bit sentinel (``arm32`` at workspace creation), R16 with the
16-bit one.  The routed partial travels in R32 whenever it is not exactly a 16-bit input
(finalize result, ``scale != 1``, shared added before the reduce): rounding it to 16 bits
before the sum would break the one-rounding contract (DESIGN §1).  A plain 16-bit routed
partial with scale 1 travels in R16 columns ``[0, WIDTH)`` (``SLOT32=False``, chosen per
call).  The lane's shared partial is an exact 16-bit input and travels in R16 columns
``[WIDTH, WIDTH + SH)``.

Who writes what.  Program p handles tokens p, p+P, ... (persistent grid-stride ``while``
loop; the same token -> program map on every rank).  For its token t it

1. *publishes*: for every chunk of BLOCK columns computes this rank's partial in fp32
   (finalize: ``sum_{k ascending} w[t,k] * expert_out[idx[t,k]]``, slots with idx == -1 are
   masked so their row is never loaded; times ``scale``; plus ``shared`` for the standalone
   op), canonicalizes -0.0 and stores it into slot ``(stage, rank, t)`` of every rank
   (itself included); the lane's shared chunks likewise into R16;
2. *reduces*: for every chunk polls its local slots of all W sources ([W_P2, BLOCK] tile,
   bounded wait), sums them in rank order in fp32 (+ residual), stores the fp32 sum into
   its scratch row, accumulates the sum of squares, writes ``residual_out`` (rounded once)
   and re-arms the slots it read (``lamport.rearm``: a CTA barrier first, so no thread of
   the CTA clears an element another thread has not read yet); the lane's shared chunks are summed the same way and
   written to ``shared_sum`` (fp32);
3. *normalizes*: ``rstd = rsqrt(ssq / WIDTH + eps)``, then chunk by chunk
   ``round(scratch * rstd * gamma)``.  Phase 3 reads back what the same program wrote in
   phase 2; a CTA barrier (``tl.debug_barrier``) orders the two phases.  When the row fits
   one chunk (``CHUNKS == 1``) the sum stays in registers and scratch is not touched.

World size 1 (``W == 1``): no slots at all, phase 1 writes the partial (+ residual) straight
into the scratch row: still one launch, no communication.

Who re-arms what, and why it cannot race.  The consumer re-arms its own slots right after
summing them into scratch (it is their only reader: one program per token, G = 1).  Slot
sets rotate over NUM_STAGES (3) stages on the device-side counter advanced by
``finish_launch``, so a producer's next write into a slot set comes after every rank
re-armed it (argument in ``lamport.py``).  All ranks must launch the kernels of one
workspace in the same order.

Interpreter safety.  Program p only waits for token p (p+P, ...), which the peers' program
p publishes before it waits itself, so running the programs of one launch one after
another (the interpreter) cannot deadlock.  A G > 1 programs-per-token tactic (one token's
statistics gathered from several programs) would not be interpreter-safe and is not
implemented: M = 1 runs on one program.

Bounded waits: a wait that passes its deadline poisons the workspace; the program then
skips the rest of its work (outputs of that call are undefined; the host raises).
"""

import triton
import triton.language as tl

from .lamport import (canonicalize, finish_launch, is_poisoned, now_ns, rearm, round_to, wait_ready)


@triton.jit
def _partial_chunk(t, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr, scale,
                   WIDTH: tl.constexpr, TOP_K: tl.constexpr, FINALIZE: tl.constexpr,
                   HAS_SCALE: tl.constexpr, SHARED_ADD: tl.constexpr):
    """This rank's fp32 partial for columns ``col`` of token ``t``."""
    t64 = t.to(tl.int64)
    if FINALIZE:
        acc = tl.zeros(col.shape, dtype=tl.float32)
        for k in tl.static_range(TOP_K):  # ascending k, fp32; unrolled so all row loads are in flight
            e = tl.load(idx_ptr + t64 * TOP_K + k).to(tl.int64)
            wk = tl.load(w_ptr + t64 * TOP_K + k).to(tl.float32)
            row = tl.load(eo_ptr + e * WIDTH + col, mask=cmask & (e >= 0), other=0.0)
            acc += tl.where(e >= 0, wk * row.to(tl.float32), 0.0)
    else:
        acc = tl.load(routed_ptr + t64 * WIDTH + col, mask=cmask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc = acc * scale
    if SHARED_ADD:
        acc += tl.load(shared_ptr + t64 * WIDTH + col, mask=cmask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _finish_chunk(s, t64, col, cmask, residual_ptr, resout_ptr, scratch_ptr,
                  WIDTH: tl.constexpr, CHUNKS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
    """The summed chunk ``s`` (fp32): add the residual (and store ``residual_out``, rounded once),
    zero the masked lanes, park the chunk in the fp32 scratch row when the row spans several
    chunks.  Returns the chunk; the caller adds its squares and keeps it when the row is one chunk."""
    if HAS_RESIDUAL:
        s += tl.load(residual_ptr + t64 * WIDTH + col, mask=cmask, other=0.0).to(tl.float32)
        tl.store(resout_ptr + t64 * WIDTH + col, round_to(s, DTYPE), mask=cmask)
    s = tl.where(cmask, s, 0.0)
    if CHUNKS > 1:
        tl.store(scratch_ptr + t64 * WIDTH + col, s, mask=cmask)
    return s


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns"])
def finalize_ar_norm_kernel(
    routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr, residual_ptr, gamma_ptr,
    normed_ptr, resout_ptr, shsum_ptr, scratch_ptr,
    table_ptr, ctrl_ptr, host_flag_ptr, clock_ptr,
    rank, M, timeout_ns, scale, eps,
    WIDTH: tl.constexpr, SH: tl.constexpr, MAX_TOKENS: tl.constexpr,
    W: tl.constexpr, W_P2: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FINALIZE: tl.constexpr, HAS_SCALE: tl.constexpr, SHARED_ADD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, SLOT32: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DTYPE = normed_ptr.dtype.element_ty
    CHUNKS: tl.constexpr = (WIDTH + BLOCK - 1) // BLOCK
    CHUNKS_SH: tl.constexpr = (SH + BLOCK - 1) // BLOCK
    ROW16: tl.constexpr = WIDTH + SH
    SLOT32_SRC: tl.constexpr = MAX_TOKENS * WIDTH      # one source's fp32 slot rows in a stage
    STAGE32: tl.constexpr = W * SLOT32_SRC
    SLOT16_SRC: tl.constexpr = MAX_TOKENS * ROW16
    STAGE16: tl.constexpr = W * SLOT16_SRC
    OFF16: tl.constexpr = NUM_STAGES * STAGE32 * 2     # R16 start, in 16-bit elements
    offs = tl.arange(0, BLOCK)
    srcs = tl.arange(0, W_P2)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (and its stage bump) are visible
    deadline = 0
    stage = 0
    if W > 1:
        deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
        stage = tl.load(ctrl_ptr + 0, volatile=True)
        my32 = tl.load(table_ptr + rank).to(tl.pointer_type(tl.float32))
        my16 = tl.load(table_ptr + rank).to(tl.pointer_type(DTYPE)) + OFF16
    go = True
    if W > 1:
        go = not is_poisoned(ctrl_ptr)
    if go:
        t = pid
        while t < M:
            t64 = t.to(tl.int64)
            ssq = tl.zeros([BLOCK], dtype=tl.float32)
            keep = tl.zeros([BLOCK], dtype=tl.float32)  # the row sum when it fits one chunk
            ok = 1
            if W == 1:
                # ---- no communication: partial (+ residual) straight into scratch
                for c in range(CHUNKS):
                    col = c * BLOCK + offs
                    cmask = col < WIDTH
                    s = _partial_chunk(t, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr,
                                       scale, WIDTH, TOP_K, FINALIZE, HAS_SCALE, SHARED_ADD)
                    s = _finish_chunk(s, t64, col, cmask, residual_ptr, resout_ptr, scratch_ptr,
                                      WIDTH, CHUNKS, HAS_RESIDUAL, DTYPE)
                    ssq += s * s
                    if CHUNKS == 1:
                        keep = s
                for c in range(CHUNKS_SH):
                    col = c * BLOCK + offs
                    cmask = col < SH
                    v = tl.load(shared_ptr + t64 * SH + col, mask=cmask, other=0.0).to(tl.float32)
                    tl.store(shsum_ptr + t64 * SH + col, v, mask=cmask)
            else:
                # ---- phase 1: publish this rank's partial into slot (stage, rank, t) of every rank
                for c in range(CHUNKS):
                    col = c * BLOCK + offs
                    cmask = col < WIDTH
                    x = _partial_chunk(t, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr,
                                       scale, WIDTH, TOP_K, FINALIZE, HAS_SCALE, SHARED_ADD)
                    if SLOT32:
                        x = canonicalize(x)
                        off = stage * STAGE32 + rank * SLOT32_SRC + t64 * WIDTH + col
                        for d in tl.static_range(W):
                            peer = tl.load(table_ptr + d).to(tl.pointer_type(tl.float32))
                            tl.store(peer + off, x, mask=cmask)
                    else:
                        x16 = canonicalize(x.to(DTYPE))  # exact: x is a 16-bit input (scale 1)
                        off = OFF16 + stage * STAGE16 + rank * SLOT16_SRC + t64 * ROW16 + col
                        for d in tl.static_range(W):
                            peer = tl.load(table_ptr + d).to(tl.pointer_type(DTYPE))
                            tl.store(peer + off, x16, mask=cmask)
                for c in range(CHUNKS_SH):
                    col = c * BLOCK + offs
                    cmask = col < SH
                    x16 = canonicalize(tl.load(shared_ptr + t64 * SH + col, mask=cmask, other=0.0))
                    off = OFF16 + stage * STAGE16 + rank * SLOT16_SRC + t64 * ROW16 + WIDTH + col
                    for d in tl.static_range(W):
                        peer = tl.load(table_ptr + d).to(tl.pointer_type(DTYPE))
                        tl.store(peer + off, x16, mask=cmask)
                # ---- phase 2: poll local slots, rank-order fp32 sum, scratch, re-arm
                for c in range(CHUNKS):
                    col = c * BLOCK + offs
                    cmask = col < WIDTH
                    rmask = (srcs[:, None] < W) & cmask[None, :]
                    if SLOT32:
                        rows = my32 + stage * STAGE32 + srcs[:, None] * SLOT32_SRC + t64 * WIDTH + col[None, :]
                    else:
                        rows = my16 + stage * STAGE16 + srcs[:, None] * SLOT16_SRC + t64 * ROW16 + col[None, :]
                    if ok:
                        ok = wait_ready(rows, rmask, ctrl_ptr, host_flag_ptr, clock_ptr, deadline,
                                        USE_GLOBALTIMER).to(tl.int32)
                    if ok:
                        s = tl.zeros([BLOCK], dtype=tl.float32)
                        for src in tl.static_range(W):  # rank order, fp32
                            if SLOT32:
                                p = my32 + stage * STAGE32 + src * SLOT32_SRC + t64 * WIDTH + col
                            else:
                                p = my16 + stage * STAGE16 + src * SLOT16_SRC + t64 * ROW16 + col
                            s += tl.load(p, mask=cmask, other=0.0, volatile=True).to(tl.float32)
                        s = _finish_chunk(s, t64, col, cmask, residual_ptr, resout_ptr, scratch_ptr,
                                          WIDTH, CHUNKS, HAS_RESIDUAL, DTYPE)
                        ssq += s * s
                        if CHUNKS == 1:
                            keep = s
                        if SLOT32:
                            rearm(rows, rmask, tl.float32)  # CTA barrier first (lamport.rearm)
                        else:
                            rearm(rows, rmask, DTYPE)
                for c in range(CHUNKS_SH):
                    col = c * BLOCK + offs
                    cmask = col < SH
                    rmask = (srcs[:, None] < W) & cmask[None, :]
                    rows = my16 + stage * STAGE16 + srcs[:, None] * SLOT16_SRC + t64 * ROW16 + WIDTH + col[None, :]
                    if ok:
                        ok = wait_ready(rows, rmask, ctrl_ptr, host_flag_ptr, clock_ptr, deadline,
                                        USE_GLOBALTIMER).to(tl.int32)
                    if ok:
                        v = tl.zeros([BLOCK], dtype=tl.float32)
                        for src in tl.static_range(W):
                            p = my16 + stage * STAGE16 + src * SLOT16_SRC + t64 * ROW16 + WIDTH + col
                            v += tl.load(p, mask=cmask, other=0.0, volatile=True).to(tl.float32)
                        tl.store(shsum_ptr + t64 * SH + col, v, mask=cmask)
                        rearm(rows, rmask, DTYPE)
            # ---- phase 3: RMSNorm from the fp32 scratch row (written by this program)
            tl.debug_barrier()
            if ok:
                rstd = tl.rsqrt(tl.sum(ssq, axis=0) / WIDTH + eps)
                for c in range(CHUNKS):
                    col = c * BLOCK + offs
                    cmask = col < WIDTH
                    if CHUNKS == 1:
                        s = keep
                    else:
                        s = tl.load(scratch_ptr + t64 * WIDTH + col, mask=cmask, other=0.0)
                    g = tl.load(gamma_ptr + col, mask=cmask, other=0.0).to(tl.float32)
                    tl.store(normed_ptr + t64 * WIDTH + col, round_to(s * rstd * g, DTYPE), mask=cmask)
            t += nprog
    if W > 1:
        finish_launch(ctrl_ptr, nprog, NUM_STAGES)
