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
    TAGS tags[stage][src][token][TAG_STRIDE]      int32 at byte TAG_OFF: the call tag of each chunk
                                                  (routed chunk c at c, shared chunk c at CHUNKS + c)
    scratch[token][WIDTH]                         fp32, local to the rank (not symmetric)

R32 and TAGS are armed with the 32-bit sentinel (``arm32`` at workspace creation), R16 with the
16-bit one.  The routed partial travels in R32 whenever it is not exactly a 16-bit input
(finalize result, ``scale != 1``, shared added before the reduce): rounding it to 16 bits
before the sum would break the one-rounding contract (DESIGN §1).  A plain 16-bit routed
partial with scale 1 travels in R16 columns ``[0, WIDTH)`` (``SLOT32=False``, chosen per
call).  The lane's shared partial is an exact 16-bit input and travels in R16 columns
``[WIDTH, WIDTH + SH)``.

Who writes what.  Work item (token t, slice g), g < G, is handled by program
(t * G + g) % P (persistent grid-stride ``while`` loop; the same item -> program map on
every rank; G, the slices per token, is a runtime argument the host picks per call, the
same on every rank).  Slice g owns the chunks c = g, g + G, ... of BLOCK columns of the
routed row (and of the lane's shared row).  For its item the program

1. *publishes*: for each of its chunks computes this rank's fp32 partial (as
   ``numerics.py`` defines; finalize:
   ``sum_{k ascending} w[t,k] * expert_out[idx[t,k]]``, slots with idx == -1 are masked so
   their row is never loaded; times ``scale``; plus ``shared`` for the standalone op),
   canonicalizes -0.0 and stores it into slot ``(stage, rank, t)`` of every rank (itself
   included), and the call's tag into the chunk's tag slot; the lane's shared chunks likewise
   into R16.  With the triple it first checks token t's ``expanded_idx`` row against the rows of
   ``expert_out`` (``lamport.idx_in_range``): an index out of range is never read; the rank posts
   an INDEX fault and publishes nothing for the item;
2. *reduces*: for each of its chunks polls its local slots of all W sources ([W_P2, BLOCK]
   tile) and their W tag slots in one bounded wait, checks every tag against its own (another
   call's tag: a MISMATCH fault, nothing is summed), sums them in rank order in fp64 (+ residual) and rounds once to
   fp32, stores the fp32 sum into the scratch row, accumulates the fp64 sum of squares,
   writes ``residual_out`` (rounded once) and re-arms the slots it read (``lamport.rearm``:
   a CTA barrier first, so no thread of the CTA clears an element another thread has not
   read yet) and the tag slots; the lane's shared chunks are summed the same way and written to
   ``shared_sum`` (fp32);
3. *normalizes*.  G = 1: the program has the whole row; ``rstd = numerics.rms_rstd(ssq)``
   (IEEE fp64), then ``round(scratch * rstd * gamma)`` in tiles of NORM_BLOCK columns (the
   K3 row in one tile, so its loads are all in flight together); a CTA barrier
   orders phase 2's scratch stores before these loads; when the row fits one chunk
   (``CHUNKS == 1``) the sum stays in registers and scratch is not touched.  G > 1: the
   program stores its slice's fp64 statistic into ``sq[t, g]``, then (CTA barrier, then an
   acq_rel ``atomic_add`` on the local counter ``cnt[t]``) the program that arrives last
   adds ``sq[t, 0..G-1]`` (one fixed reduction tree: deterministic, the same on every
   rank; in fp64 its order does not reach the fp32 statistic), resets ``cnt[t]`` to 0 and
   normalizes the whole row from scratch (volatile loads: other SMs wrote it).  Nobody
   waits on the counter.

``scratch``, ``sq`` and ``cnt`` are local to the rank (never addressed by peers); each
element of scratch/sq is written by one program per call and read after the counter's
acquire (or by the same program after a CTA barrier).

World size 1 (``W == 1``): no slots at all, phase 1 writes the partial (+ residual) straight
into the scratch row: still one launch, no communication.  An index out of range posts its
INDEX fault into the op's local fault block (a world-of-one workspace: no peers, no slots).

Who re-arms what, and why it cannot race.  Every slot chunk is read by exactly one program
(the owner of its slice) on its rank, which re-arms it right after summing it.  Slot sets
rotate over NUM_STAGES (3) stages on the device-side counter advanced by
``finish_launch``, so a producer's next write into a slot set comes after every rank
re-armed it (argument in ``lamport.py``).  All ranks must launch the kernels of one
workspace in the same order (and with the same G).

Interpreter safety.  Program p only waits for the chunks of its own items, which the
peers' program p publishes (same item order on every rank) before it waits itself, so
running the programs of one launch one after another (the interpreter) cannot deadlock;
the arrival counter is never waited on.

Bounded waits and faults (``lamport.py``): a wait that passes its deadline posts a TIMEOUT
record (naming the first source still armed) into every rank's fault word; a wait also ends
when the fault word is set.  The program then skips the rest of its work (outputs of that call
are undefined; the host raises on every rank).  Tag slots rotate with their stage and are
re-armed by their only reader, exactly as the data slots, so the stage argument covers them.
World size 1 has no fault word: an index out of range there is skipped (never read).
"""

import triton
import triton.language as tl

from .lamport import (arm, await_slots, canonicalize, check_start, fault_record, finish_launch, idx_in_range, now_ns,
                      post_fault, rearm, region_ptr, round_to)
from .numerics import rank_sum64, rms_rstd, routed32, sq64


@triton.jit
def _partial_chunk(t, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr, scale,
                   WIDTH: tl.constexpr, TOP_K: tl.constexpr, FINALIZE: tl.constexpr,
                   HAS_SCALE: tl.constexpr, SHARED_ADD: tl.constexpr):
    """This rank's fp32 partial for columns ``col`` of token ``t`` (``numerics.py``)."""
    t64 = t.to(tl.int64)
    acc = routed32(t64, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, scale, WIDTH, TOP_K, FINALIZE, HAS_SCALE)
    if SHARED_ADD:
        acc += tl.load(shared_ptr + t64 * WIDTH + col, mask=cmask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _publish(table_ptr, off, x, cmask, W: tl.constexpr):
    """Store chunk ``x`` at element offset ``off`` (in units of ``x``'s dtype) of every rank's
    region, itself included: the Lamport publish."""
    for d in tl.static_range(W):
        tl.store(region_ptr(table_ptr, d, 0, x.dtype) + off, x, mask=cmask)


@triton.jit
def _publish_tag(table_ptr, TAG_OFF: tl.constexpr, off, tag, W: tl.constexpr):
    """Store the call tag into tag slot ``off`` (int32 elements from TAG_OFF) of every rank."""
    for d in tl.static_range(W):
        tl.store(region_ptr(table_ptr, d, TAG_OFF, tl.int32) + off, tag)


@triton.jit
def _finish_chunk(s, t64, col, cmask, residual_ptr, resout_ptr, scratch_ptr,
                  WIDTH: tl.constexpr, CHUNKS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
    """The summed chunk ``s`` (fp64): add the residual, round to fp32 once (``residual_out`` is
    that value rounded to 16 bits), zero the masked lanes, park the chunk in the fp32 scratch
    row when the row spans several chunks.  Returns the chunk; the caller adds its squares and
    keeps it when the row is one chunk."""
    if HAS_RESIDUAL:
        s += tl.load(residual_ptr + t64 * WIDTH + col, mask=cmask, other=0.0).to(tl.float64)
    s = s.to(tl.float32)
    if HAS_RESIDUAL:
        tl.store(resout_ptr + t64 * WIDTH + col, round_to(s, DTYPE), mask=cmask)
    s = tl.where(cmask, s, 0.0)
    if CHUNKS > 1:
        tl.store(scratch_ptr + t64 * WIDTH + col, s, mask=cmask)
    return s


@triton.jit
def _normalize_chunk(s, t64, col, cmask, rstd, gamma_ptr, normed_ptr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """``normed = round(fp32(fp32(s * rstd) * gamma))`` for one chunk: the latent's only rounding."""
    g = tl.load(gamma_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + t64 * WIDTH + col, round_to(s * rstd * g, DTYPE), mask=cmask)


@triton.jit
def _normalize_row(t64, rstd, scratch_ptr, gamma_ptr, normed_ptr, WIDTH: tl.constexpr,
                   NORM_BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    """Normalize row t from the fp32 scratch row in tiles of NORM_BLOCK (the whole K3 row in
    one tile: all loads in flight at once; volatile: other programs may have written it)."""
    offs = tl.arange(0, NORM_BLOCK)
    for c in range((WIDTH + NORM_BLOCK - 1) // NORM_BLOCK):
        col = c * NORM_BLOCK + offs
        cmask = col < WIDTH
        s = tl.load(scratch_ptr + t64 * WIDTH + col, mask=cmask, other=0.0, volatile=True)
        _normalize_chunk(s, t64, col, cmask, rstd, gamma_ptr, normed_ptr, WIDTH, DTYPE)


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "G", "tag", "R"])
def finalize_ar_norm_kernel(
    routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr, residual_ptr, gamma_ptr,
    normed_ptr, resout_ptr, shsum_ptr, scratch_ptr, sq_ptr, cnt_ptr,
    table_ptr, ctrl_ptr, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr,
    rank, M, timeout_ns, G, tag, R, scale, eps,
    WIDTH: tl.constexpr, SH: tl.constexpr, MAX_TOKENS: tl.constexpr,
    W: tl.constexpr, W_P2: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr, SQ_STRIDE: tl.constexpr, NORM_BLOCK: tl.constexpr,
    TAG_OFF: tl.constexpr, TAG_STRIDE: tl.constexpr,
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
    wmask = srcs < W
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (and its stage bump) are visible
    deadline = 0
    stage = 0
    if W > 1:
        deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
        stage = tl.load(ctrl_ptr + 0, volatile=True)
        my32 = region_ptr(table_ptr, rank, 0, tl.float32)  # 16-byte aligned: the polls vectorize
        my16 = region_ptr(table_ptr, rank, 0, DTYPE) + OFF16
        my_tags = region_ptr(table_ptr, rank, TAG_OFF, tl.int32)
    go = True
    if W > 1:
        go = check_start(fault_ptr, host_flag_ptr)
    if go:
        item = pid
        while item < M * G:
            t = item // G
            g = item % G            # this item's slice: chunks g, g + G, ...
            t64 = t.to(tl.int64)
            ssq = tl.zeros([BLOCK], dtype=tl.float64)  # fp64 statistic (numerics.py)
            keep = tl.zeros([BLOCK], dtype=tl.float32)  # the row sum when it fits one chunk
            ok = rank * 0 + 1
            if FINALIZE:
                # an index out of range is never dereferenced: post INDEX (W = 1 too: into the op's
                # local fault block, so the host raises instead of returning an unwritten row), skip the item
                if not idx_in_range(idx_ptr, t64, R, TOP_K):
                    ok = rank * 0
                    post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(4, rank, rank), tag, -1, W)
            if W == 1:
                # ---- no communication: partial (+ residual) straight into scratch
                for j in range(CHUNKS):  # chunks g, g + G, ... (G is a runtime value)
                    c = g + j * G
                    if (c < CHUNKS) & (ok != 0):
                        col = c * BLOCK + offs
                        cmask = col < WIDTH
                        s = _partial_chunk(t, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr,
                                           scale, WIDTH, TOP_K, FINALIZE, HAS_SCALE, SHARED_ADD)
                        s = _finish_chunk(s.to(tl.float64), t64, col, cmask, residual_ptr, resout_ptr,
                                          scratch_ptr, WIDTH, CHUNKS, HAS_RESIDUAL, DTYPE)
                        ssq += sq64(s)
                        if CHUNKS == 1:
                            keep = s
                for j in range(CHUNKS_SH):  # chunks g, g + G, ... (G is a runtime value)
                    c = g + j * G
                    if (c < CHUNKS_SH) & (ok != 0):
                        col = c * BLOCK + offs
                        cmask = col < SH
                        v = tl.load(shared_ptr + t64 * SH + col, mask=cmask, other=0.0).to(tl.float32)
                        tl.store(shsum_ptr + t64 * SH + col, v, mask=cmask)
            else:
                # ---- phase 1: publish this rank's partial into slot (stage, rank, t) of every rank,
                #      and the call tag into tag slot (stage, rank, t, chunk)
                tag_row = ((stage * W + rank) * MAX_TOKENS + t64) * TAG_STRIDE
                for j in range(CHUNKS):  # chunks g, g + G, ... (G is a runtime value)
                    c = g + j * G
                    if (c < CHUNKS) & (ok != 0):
                        col = c * BLOCK + offs
                        cmask = col < WIDTH
                        x = _partial_chunk(t, col, cmask, routed_ptr, eo_ptr, w_ptr, idx_ptr, shared_ptr,
                                           scale, WIDTH, TOP_K, FINALIZE, HAS_SCALE, SHARED_ADD)
                        if SLOT32:
                            _publish(table_ptr, stage * STAGE32 + rank * SLOT32_SRC + t64 * WIDTH + col,
                                     canonicalize(x), cmask, W)
                        else:  # exact: x is a 16-bit input (scale 1)
                            _publish(table_ptr, OFF16 + stage * STAGE16 + rank * SLOT16_SRC + t64 * ROW16 + col,
                                     canonicalize(x.to(DTYPE)), cmask, W)
                        _publish_tag(table_ptr, TAG_OFF, tag_row + c, tag, W)
                for j in range(CHUNKS_SH):  # chunks g, g + G, ... (G is a runtime value)
                    c = g + j * G
                    if (c < CHUNKS_SH) & (ok != 0):
                        col = c * BLOCK + offs
                        cmask = col < SH
                        x16 = canonicalize(tl.load(shared_ptr + t64 * SH + col, mask=cmask, other=0.0))
                        _publish(table_ptr, OFF16 + stage * STAGE16 + rank * SLOT16_SRC + t64 * ROW16 + WIDTH + col,
                                 x16, cmask, W)
                        _publish_tag(table_ptr, TAG_OFF, tag_row + CHUNKS + c, tag, W)
                # ---- phase 2: poll local slots with their tags, check the tags, rank-order fp64
                #      sum -> fp32, scratch, re-arm (slots and tags)
                tag_rows = ((stage * W + srcs) * MAX_TOKENS + t64) * TAG_STRIDE
                # ---- phase 2: poll local slots, rank-order fp64 sum -> fp32, scratch, re-arm
                for j in range(CHUNKS):  # chunks g, g + G, ... (G is a runtime value)
                    c = g + j * G
                    if c < CHUNKS:
                        col = c * BLOCK + offs
                        cmask = col < WIDTH
                        rmask = (srcs[:, None] < W) & cmask[None, :]
                        if SLOT32:
                            rows = my32 + stage * STAGE32 + srcs[:, None] * SLOT32_SRC + t64 * WIDTH + col[None, :]
                        else:
                            rows = my16 + stage * STAGE16 + srcs[:, None] * SLOT16_SRC + t64 * ROW16 + col[None, :]
                        tptrs = my_tags + tag_rows + c
                        if ok:
                            ok = await_slots(rows, rmask, tptrs, wmask, tag, fault_ptr, ftab_ptr, host_flag_ptr,
                                             clock_ptr, deadline, rank, W, USE_GLOBALTIMER)
                        if ok:
                            if SLOT32:
                                s = rank_sum64(my32 + stage * STAGE32 + t64 * WIDTH + col, SLOT32_SRC, cmask, W)
                            else:
                                s = rank_sum64(my16 + stage * STAGE16 + t64 * ROW16 + col, SLOT16_SRC, cmask, W)
                            s = _finish_chunk(s, t64, col, cmask, residual_ptr, resout_ptr, scratch_ptr,
                                              WIDTH, CHUNKS, HAS_RESIDUAL, DTYPE)
                            ssq += sq64(s)
                            if CHUNKS == 1:
                                keep = s
                            if SLOT32:
                                rearm(rows, rmask, tl.float32)  # CTA barrier first (lamport.rearm)
                            else:
                                rearm(rows, rmask, DTYPE)
                            arm(tptrs, wmask, tl.int32)  # (after the same barrier)
                for j in range(CHUNKS_SH):  # chunks g, g + G, ... (G is a runtime value)
                    c = g + j * G
                    if c < CHUNKS_SH:
                        col = c * BLOCK + offs
                        cmask = col < SH
                        rmask = (srcs[:, None] < W) & cmask[None, :]
                        rows = my16 + stage * STAGE16 + srcs[:, None] * SLOT16_SRC + t64 * ROW16 + WIDTH + col[None, :]
                        tptrs = my_tags + tag_rows + CHUNKS + c
                        if ok:
                            ok = await_slots(rows, rmask, tptrs, wmask, tag, fault_ptr, ftab_ptr, host_flag_ptr,
                                             clock_ptr, deadline, rank, W, USE_GLOBALTIMER)
                        if ok:
                            v = rank_sum64(my16 + stage * STAGE16 + t64 * ROW16 + WIDTH + col, SLOT16_SRC,
                                           cmask, W)
                            tl.store(shsum_ptr + t64 * SH + col, v.to(tl.float32), mask=cmask)
                            rearm(rows, rmask, DTYPE)
                            arm(tptrs, wmask, tl.int32)
            # ---- phase 3: RMSNorm of row t from its fp32 scratch row
            tl.debug_barrier()  # every thread's scratch stores precede what follows
            if ok:
                if G == 1:
                    # the whole row is this program's: its statistic is complete
                    rstd = rms_rstd(tl.sum(ssq, axis=0), WIDTH, eps)
                    if CHUNKS == 1:
                        _normalize_chunk(keep, t64, offs, offs < WIDTH, rstd, gamma_ptr, normed_ptr, WIDTH, DTYPE)
                    else:
                        _normalize_row(t64, rstd, scratch_ptr, gamma_ptr, normed_ptr, WIDTH, NORM_BLOCK, DTYPE)
                else:
                    # G slices: park this slice's fp64 statistic; the program completing row t
                    # (arrival counter, acq_rel) adds the G statistics in slice order and
                    # normalizes the whole row from scratch.  Nobody waits on the counter.
                    tl.store(sq_ptr + t64 * SQ_STRIDE + g, tl.sum(ssq, axis=0))
                    tl.debug_barrier()
                    old = tl.atomic_add(cnt_ptr + t, 1)  # release: scratch + sq; acquire: the others'
                    if old == G - 1:
                        tl.store(cnt_ptr + t, 0)
                        js = tl.arange(0, SQ_STRIDE)
                        sqs = tl.load(sq_ptr + t64 * SQ_STRIDE + js, mask=js < G, other=0.0, volatile=True)
                        rstd = rms_rstd(tl.sum(sqs, axis=0), WIDTH, eps)  # fixed tree: same on every rank
                        _normalize_row(t64, rstd, scratch_ptr, gamma_ptr, normed_ptr, WIDTH, NORM_BLOCK, DTYPE)
            item += nprog
    if W > 1:
        finish_launch(ctrl_ptr, nprog, NUM_STAGES)
