"""Lamport slot primitives shared by every k3tail collective.

Protocol
========
Buffers.  Every rank owns one symmetric region (same layout on every rank) that peers
address through an int64 *peer table* of base pointers (``table[d]`` = rank d's region).
A region is carved into *slots*; a slot holds one fragment of one producer's data for
one consumer (the owner of the region).

Sentinel.  A slot element is *armed* when it holds the bit pattern of -0.0 of the slot's
type: 0x8000 for bf16/fp16 slots, 0x80000000 for fp32 slots (fp32 payloads carry partial
sums that the rounding contract forbids rounding to 16 bits before they are added).  Real data
never equals the sentinel because every writer
*canonicalizes* -0.0 to +0.0 before it stores (:func:`canonicalize`).  Comparisons are
made on the integer bits, never on floats (-0.0 == +0.0 as floats).

Who writes what.
  * producers store their fragment into the consumer's slot with plain (remote) stores;
  * the consumer polls its *local* copy with volatile loads (:func:`wait_ready`) until no
    element of the fragment is the sentinel; a peer's memory is never polled;
  * the consumer then reads the data (volatile again, so no stale L1 line is reused)
    and *re-arms* what it read (:func:`arm`), i.e. the clear is consumer-side.

Re-arm only after a CTA barrier.  Triton assigns a layout to every memory operation on
its own (coalescing), so even a store through the very pointer tensor that was loaded may
put an element on another thread than the one that read it.  Without a barrier, one
thread can re-arm an element before another thread of the CTA has read it: seen on the
H200 (wrong sums; invisible under the interpreter).  :func:`rearm` is
``tl.debug_barrier()`` followed by the sentinel store; use it for every consumer-side clear.

Why it cannot race.  Each 16-bit element is written by exactly one producer with one
store, so an element is either the sentinel or final data: no tearing, and no ordering
between elements is needed because the consumer checks every element it uses.  A
producer's *next* write into a slot must be causally after the consumer's re-arm of it.
The standalone collectives rotate over ``NUM_STAGES`` (3) slot sets on a device-side
counter (so CUDA-graph replay advances it; a host counter would freeze at capture):
when a producer starts call n+1 it has seen every rank's data of call n, so every rank
finished call n-1 (including its re-arm of the stage that call n+1 reuses when 2 stages
rotate); the third stage is margin.  The kernels that use other arguments (the
TAIL_FUSION chain) state theirs in their own docstring.

One decision per program (CTA-uniform waits).  A program is many threads (warps), and Triton
*replicates* a scalar or a small tensor (a [W] vector of tag slots, the fault word, the clock) in
every warp: each warp loads and compares its own copy, and a reduction over a replicated tensor stays
inside the warp.  For values that peers write while we poll, the copies can differ: one warp sees the
last tag slot arrive, the next warp's load came a moment earlier.  The warps then leave the poll loop
in different iterations, and since ``bar.sync 0`` counts arrivals, not call sites, a warp's re-arm
barrier pairs with its siblings' reduction barrier in the loop: the early warp re-arms slots that the
others have not read yet, and they then sum the sentinel (-0.0) in place of a peer's data.  Seen on the
H100 (issue 28): the peer collectives' fp32 all-reduce and 16-bit gather in loopback returned a wrong
sum in 10-30 % of the elements of every work item of one program of one launch, in a few calls out of
ten, at W = 3 and M > 64, PDL on or off; the interpreter runs a program as one thread and cannot
show it.  Rule: every branch of a wait (arrived, another tag, fault word set, deadline passed) is
decided by :func:`cta_any`, a CTA-wide vote (``bar.red.or``), so all warps of a program take the same
branch in the same iteration; so is the fault word at a launch's start (:func:`check_start`).

Bounded waits.  Every poll carries a deadline.  On the GPU the clock is the device
global timer (ns).  Under the Triton interpreter (``TRITON_INTERPRET=1``) inline asm is
unavailable, so the clock is a *clock page*: an int64 that a host thread of the process
refreshes with ``time.monotonic_ns()`` (see ``k3tail.runtime.clock``).  A poll also exits
when the *fault word* is set (below), so one rank's failure ends every rank's waits.

Call tags (one call, one pairing; DESIGN §9).  Every launch that publishes into Lamport slots
carries the caller's *call tag*, a non-negative int32 that is the same on every rank for the
same call and differs between calls (``k3tail.ops.fault.call_tag``: the group's call sequence
number, the layer and M; a CUDA graph captures it as a constant, and every rank captures the
same).  Producers publish it in a 32-bit *tag slot* next to each fragment they publish (armed
with the 32-bit sentinel like fp32 slots; a tag is >= 0, so it never equals the sentinel);
the fragment's consumer polls the tag slot together with the data (one loop, no extra round
trip), compares it with its own tag before it uses the data and re-arms it with the data.  A
peer whose call is not this call (it skipped or rejected a call, or called with another M or
from another layer) publishes another tag: the consumer raises a MISMATCH fault instead of
summing two calls.

Fault word and fault record.  Word ``CTRL_POISON`` of a *fault block* (int32
``[CTRL_WORDS]``) is the fault word: 0 while healthy, else a packed fault record
(:func:`fault_record`: reason code, failing rank, detecting rank).  Fault blocks live in the
symmetric regions, so a peer can write them: ``ftab[d]`` is rank d's fault block.  A
standalone op's fault block is the control block of its own workspace; the ops of a
``K3MoETail`` share ONE fault block per group (``k3tail.module``), so a fault in any of the
group's workspaces ends the waits in all of them.  A rank that detects a fault (deadline
passed: TIMEOUT; wrong tag: MISMATCH; an expert index out of range: INDEX) *posts* the record
into every rank's fault word, its own included (:func:`post_fault`: ``atomic_cas(0 -> record)``,
so the first record wins on each rank and a record is never torn), and sets its host mirror.
Every poll exits when its local fault word is set, and every launch that finds it set at its
start does nothing but set the host mirror.  The host raises (``k3tail.errors``), naming the
reason, the failing and the detecting rank from the record.  ``CTRL_FAULT_TAG`` /
``CTRL_FAULT_GOT`` hold the detecting rank's own tag and the tag it saw (its own block only).
The host's abort path (a rank that rejects its inputs) posts a record with
``abort_kernel``.

A fault record names its call (``CTRL_CALL``).  Word ``CTRL_CALL`` of a fault block counts the
calls this rank has started on the device: the caller that owns the call tag (``K3MoETail``, or a
standalone op called without a tag) advances it on the stream before the call's first launch
(``Workspace.advance_call``; a CUDA graph captures the increment, so every replay advances it too,
and a rank's n-th call has number n on every rank, as calls pair by order).  Every record carries
the poster's number (bits 20-30, mod 2^11): :func:`post_fault` takes it from its own block, and the
abort path of a rank that rejects call n + 1 before launching it names n + 1.  A rank's launch obeys
a fault word only when the record's call is not later than its own (:func:`is_poisoned`, mod 2^11
with a window of 1024 calls; ranks are never more than a call or two apart).  Why: the tiers are
barrier-free, so a rank can finish call n, reject call n + 1 and post its record while a peer's last
launch of call n has not started yet.  That peer's data of call n are all published (the poster
consumed them), so the peer must finish call n exactly; before this rule its start check saw the
word and skipped the launch: one rank failed call n while the others returned it (seen under the
interpreter, ``test_pairing.py``; on a GPU the skipping rank would have returned an unwritten
output).  The peer obeys the record at its next launch, which belongs to call n + 1.

Control block (int32, in this rank's region; only the fault word is ever written by peers)::

    [CTRL_STAGE]      stage counter, advanced by the last program of each launch
    [CTRL_POISON]     the fault word (see above)
    [CTRL_DONE]       programs of the current launch that finished (last one resets it)
    [CTRL_USER..7]    per-op state (e.g. the exchange's barrier epoch)
    [CTRL_FAULT_TAG]  the detecting rank's tag, [CTRL_FAULT_GOT] the tag it saw
    [CTRL_CALL]       calls this rank started (advanced by the host, on the stream; see above)
"""

import os

import triton
import triton.language as tl

# Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even); kernels
# round through :func:`round_to`, which does RNE by hand under the interpreter.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

SENTINEL_BITS = -32768  # 0x8000 as int16: the bit pattern of -0.0 in bf16 and fp16
NUM_STAGES = 3

CTRL_STAGE = 0
CTRL_POISON = 1
CTRL_DONE = 2
CTRL_USER = 4
CTRL_FAULT_TAG = 8
CTRL_FAULT_GOT = 9
CTRL_CALL = 10
CALL_BITS = 11       # a record's call number: bits 20-30 (the record stays a positive int32)
CALL_SHIFT = 20
CTRL_WORDS = 16
CTRL_BYTES = CTRL_WORDS * 4

# Fault record: reason code (bits 0-3), failing rank (bits 4-11; 255 = unknown), detecting
# rank (bits 12-19), the poster's call number mod 2^11 (bits 20-30).  Always > 0.  ``k3tail.ops.fault`` decodes it.
FAULT_TIMEOUT = 1    # a peer never arrived before the deadline
FAULT_MISMATCH = 2   # a peer published another call's tag
FAULT_REJECTED = 3   # a rank rejected its inputs (host abort path)
FAULT_INDEX = 4      # an expanded_idx entry outside [-1, rows) (found on the device)
FAULT_ABORTED = 5    # a rank failed elsewhere (host abort path: another workspace, the group header)
NO_RANK = 255
NO_RANK_C = tl.constexpr(NO_RANK)


@triton.jit
def is_armed(x):
    """Elementwise: does ``x`` hold the sentinel bit pattern (-0.0 of its 16- or 32-bit type)?"""
    if x.dtype.primitive_bitwidth == 16:
        r = x.to(tl.int16, bitcast=True) == -32768
    else:
        r = x.to(tl.uint32, bitcast=True) == 0x80000000
    return r


@triton.jit
def canonicalize(x):
    """Map -0.0 to +0.0 so stored data can never equal the sentinel."""
    return tl.where(is_armed(x), tl.zeros_like(x), x)


@triton.jit
def sentinel_like(ptrs, DTYPE: tl.constexpr):
    """A block of sentinels (-0.0 bits) of ``DTYPE`` shaped like ``ptrs``."""
    if DTYPE.primitive_bitwidth == 16:
        v = tl.full(ptrs.shape, -32768, tl.int16).to(DTYPE, bitcast=True)
    else:
        v = tl.full(ptrs.shape, 0x80000000, tl.uint32).to(DTYPE, bitcast=True)
    return v


@triton.jit
def arm(ptrs, mask, DTYPE: tl.constexpr):
    """Store the sentinel into ``ptrs`` (consumer-side re-arm)."""
    tl.store(ptrs, sentinel_like(ptrs, DTYPE), mask=mask)


@triton.jit
def rearm(ptrs, mask, DTYPE: tl.constexpr):
    """Consumer-side clear: CTA barrier (every thread has read), then store the sentinel."""
    tl.debug_barrier()
    arm(ptrs, mask, DTYPE)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to ``DTYPE`` to nearest even (bit-exact on the GPU and the interpreter)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rnd = bits + 0x7FFF + ((bits >> 16) & 1)
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        hi = tl.where(is_nan, (bits >> 16) | 0x40, rnd >> 16)
        y = hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def region_ptr(table_ptr, rank, OFF: tl.constexpr, DTYPE: tl.constexpr):
    """Pointer to byte ``OFF`` (a multiple of 16) of ``rank``'s region from the peer table, typed
    ``DTYPE``.  Region bases are at least 16-byte aligned (page-aligned allocations); telling the
    compiler lets it vectorize the remote stores and local polls.  The hint must sit on the base
    pointer, the offset added after it: on the integer before the cast, or on ``(base + OFF)`` cast,
    it is lost (Triton 3.6-3.9), and every slot access stays a 32-bit (or 16-bit) load.  That matters
    most for polls: ptxas keeps volatile loads in order and issues them a pair at a time, so 32 scalar
    polls of a [8, 512] fp32 tile per thread cost 16 round trips to L2 where 8 vector polls cost 4
    (kernel A: ~14 us per work item on the H100, issue 29)."""
    tl.static_assert(OFF % 16 == 0, "region offsets are 16-byte aligned")
    base = tl.multiple_of(tl.load(table_ptr + rank).to(tl.pointer_type(DTYPE)), 16)
    return base + OFF // (DTYPE.primitive_bitwidth // 8)


@triton.jit
def peer_ptr(table_ptr, rank, DTYPE: tl.constexpr):
    """Base pointer of ``rank``'s region from the peer table, typed ``DTYPE`` (16-byte aligned:
    :func:`region_ptr`)."""
    return region_ptr(table_ptr, rank, 0, DTYPE)


@triton.jit
def now_ns(clock_ptr, USE_GLOBALTIMER: tl.constexpr):
    """Current time in ns: device global timer, or the host clock page (interpreter)."""
    if USE_GLOBALTIMER:
        t = tl.extra.cuda.globaltimer()
    else:
        t = tl.load(clock_ptr, volatile=True)
    return t


@triton.jit
def cta_any(flag):
    """``flag`` (a scalar, per thread) ORed over every thread of the program: the same answer in
    every warp (``bar.red.or.pred``, a CTA barrier that reduces a predicate; see "One decision per
    program" above).  Every thread of the program must reach it.  Under the interpreter a program
    is one thread: the flag itself."""
    if INTERPRET:
        r = flag != 0
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r", [flag.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1) != 0
    return r


@triton.jit
def is_poisoned(fault_ptr):
    """Does the fault word of this fault block hold a record (posted by this rank or a peer) of this
    rank's current call or an earlier one?  A record of a later call (a peer that finished this
    call, then failed its next) is obeyed from this rank's next call on (module docstring)."""
    word = tl.load(fault_ptr + 1, volatile=True)
    mine = tl.load(fault_ptr + 10, volatile=True)
    ahead = ((word >> 20) - mine) & 0x7FF  # how many calls the record's call is past ours (mod 2^11)
    return (word != 0) & ((ahead == 0) | (ahead >= 1024))


@triton.jit
def with_call(record, fault_ptr, adv):
    """``record`` with this rank's call number (its block's ``CTRL_CALL`` plus ``adv``) in bits 20-30."""
    call = (tl.load(fault_ptr + 10, volatile=True) + adv) & 0x7FF
    return (record & 0xFFFFF) | (call << 20)


@triton.jit
def note_fault(host_flag_ptr):
    """Tell the host: set the host mirror (pinned on CUDA)."""
    tl.atomic_xchg(host_flag_ptr, 1)


@triton.jit
def fault_record(code, failing, detector):
    """The packed fault record (see the module docstring)."""
    return code + (failing & 0xFF) * 16 + (detector & 0xFF) * 4096


@triton.jit
def post_fault(ftab_ptr, fault_ptr, host_flag_ptr, record, tag, got, W: tl.constexpr):
    """Post ``record`` into every rank's fault word (first record wins on each rank: CAS from 0),
    keep this rank's tag and the tag it saw in its own block, and set the host mirror."""
    tl.store(fault_ptr + 8, tag)
    tl.store(fault_ptr + 9, got)
    record = with_call(record, fault_ptr, 0)
    for d in tl.static_range(W):
        peer = tl.load(ftab_ptr + d).to(tl.pointer_type(tl.int32))
        tl.atomic_cas(peer + 1, 0, record, sem="acq_rel", scope="sys")
    note_fault(host_flag_ptr)


@triton.jit
def check_start(fault_ptr, host_flag_ptr):
    """At a launch's start: True when the group is healthy; else mirror the fault to the host (one
    answer for the whole program: :func:`cta_any`)."""
    dead = cta_any(is_poisoned(fault_ptr))
    if dead:
        note_fault(host_flag_ptr)
    return not dead


@triton.jit
def wait_slots(ptrs, mask, tag_ptrs, tag_mask, tag, fault_ptr, clock_ptr, deadline, USE_GLOBALTIMER: tl.constexpr):
    """Spin on local slots ``ptrs`` and tag slots ``tag_ptrs`` until no masked element of either is
    the sentinel and every tag equals ``tag``.  Returns 0 (arrived, tags equal), 1 (deadline passed),
    2 (the fault word is set) or 3 (a tag slot holds another call's tag: no need to wait for the data).
    The tags are compared inside the loop, so the fast path pays no extra load after it.

    The loop carries only a scalar (a tensor loop-carry with a reduction condition crashed the
    Triton 3.6 compiler); callers load the data again after the loop.  Every branch is a CTA-wide
    vote (:func:`cta_any`): the warps of a program see their own copies of the tags, the fault word
    and the clock, and must still leave the loop together (module docstring); the fault word and the
    clock are only consulted (two more votes) while something is pending."""
    state = 5  # 5 pending
    while state > 4:
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        tg = tl.load(tag_ptrs, mask=tag_mask, other=0, volatile=True)
        tg_armed = is_armed(tg) & tag_mask
        pending = cta_any((tl.sum((is_armed(v) & mask).to(tl.int32)) + tl.sum(tg_armed.to(tl.int32))) > 0)
        wrong = cta_any(tl.sum((tag_mask & (tg != tag) & ~tg_armed).to(tl.int32)) > 0)
        if wrong:
            state = 3
        elif pending:
            poisoned = cta_any(is_poisoned(fault_ptr))
            late = cta_any(now_ns(clock_ptr, USE_GLOBALTIMER) > deadline)
            state = tl.where(poisoned, 2, tl.where(late, 1, 5))
        else:
            state = 0
    return state


@triton.jit
def settle(state, tag_ptrs, tag_mask, tag, missing, ftab_ptr, fault_ptr, host_flag_ptr, rank, W: tl.constexpr):
    """After :func:`wait_slots`: True when the data may be used (state 0: nothing more to do).
    Another tag (3): post a MISMATCH naming the first source with another tag.  Deadline (1): post a
    TIMEOUT naming ``missing`` (the caller's first source still armed, or NO_RANK).  Fault word set
    (2): mirror it to the host."""
    if state == 3:
        srcs = tl.arange(0, tag_ptrs.shape[0])
        tg = tl.load(tag_ptrs, mask=tag_mask, other=0, volatile=True)
        wrong = tag_mask & (tg != tag) & ~is_armed(tg)
        bad = tl.min(tl.where(wrong, srcs, NO_RANK_C))
        got = tl.max(tl.where(srcs == bad, tg, -1))
        post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(2, bad, rank), tag, got, W)
    elif state == 1:
        post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(1, missing, rank), tag, -1, W)
    elif state == 2:
        note_fault(host_flag_ptr)
    return state == 0


@triton.jit
def first_armed_src(ptrs, mask, tag_ptrs, tag_mask):
    """The first source (row of a ``[W_P2, BLOCK]`` slot tile, entry of its tag vector) that still
    holds a sentinel: whom a timed-out wait names.  NO_RANK when none (it arrived just now)."""
    srcs = tl.arange(0, tag_ptrs.shape[0])
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    tg = tl.load(tag_ptrs, mask=tag_mask, other=0, volatile=True)
    rows = tl.sum((is_armed(v) & mask).to(tl.int32), axis=1) + (is_armed(tg) & tag_mask).to(tl.int32)
    return tl.min(tl.where(rows > 0, srcs, NO_RANK_C))


@triton.jit
def await_slots(ptrs, mask, tag_ptrs, tag_mask, tag, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr, deadline, rank,
                W: tl.constexpr, USE_GLOBALTIMER: tl.constexpr):
    """One bounded wait of a consumer: :func:`wait_slots`, then :func:`settle` (a timeout names the
    first source still armed, :func:`first_armed_src`).  1 (int32) when every source arrived with
    this call's tag, else 0 (the fault is posted or mirrored)."""
    state = wait_slots(ptrs, mask, tag_ptrs, tag_mask, tag, fault_ptr, clock_ptr, deadline, USE_GLOBALTIMER)
    missing = rank * 0 + NO_RANK_C
    if state == 1:
        missing = first_armed_src(ptrs, mask, tag_ptrs, tag_mask)
    return settle(state, tag_ptrs, tag_mask, tag, missing, ftab_ptr, fault_ptr, host_flag_ptr, rank, W).to(tl.int32)


@triton.jit
def start_gate(fault_ptr, ftab_ptr, host_flag_ptr, status_ptr, tag, rank, W: tl.constexpr):
    """At the start of a launch that publishes what a finalize produced: True when the group is
    healthy (:func:`check_start`) and the finalize's ``status`` word is clear; a set word (an index
    out of range) posts an INDEX fault naming this rank instead, so the launch publishes nothing."""
    go = check_start(fault_ptr, host_flag_ptr)
    if go:
        if tl.load(status_ptr) != 0:
            post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(4, rank, rank), tag, -1, W)
            go = False
    return go


@triton.jit
def idx_in_range(idx_ptr, t64, R, TOP_K: tl.constexpr):
    """Does every slot of token ``t64``'s ``expanded_idx`` row lie in ``[-1, R)``?  The finalize
    kernels check this before ``numerics.finalize32`` reads any expert row, so an index out of
    range is never dereferenced on the device (the host checks CPU tensors itself)."""
    bad = 0
    for k in tl.static_range(TOP_K):  # scalar loads, as finalize32 reads them
        e = tl.load(idx_ptr + t64 * TOP_K + k)
        bad += ((e < -1) | (e >= R)).to(tl.int32)
    return bad == 0


@triton.jit
def finish_launch(ctrl_ptr, num_programs, NUM_STAGES_: tl.constexpr):
    """Called once by every program at its end: the last one advances the stage."""
    old = tl.atomic_add(ctrl_ptr + 2, 1)
    if old == num_programs - 1:
        tl.store(ctrl_ptr + 2, 0)
        stage = tl.load(ctrl_ptr + 0, volatile=True)
        tl.store(ctrl_ptr + 0, (stage + 1) % NUM_STAGES_)


@triton.jit
def shard_of(d, HIDDEN: tl.constexpr, W: tl.constexpr):
    """``(b[d], width)`` of rank d's column shard (``b[d] = d * (H // W) + min(d, H % W)``); for
    W dividing H exactly ``(d * H / W, H / W)``, as constexpr-divisible as before."""
    Q: tl.constexpr = HIDDEN // W
    R: tl.constexpr = HIDDEN % W
    if R == 0:
        lo = d * Q
        n = Q
    else:
        lo = d * Q + tl.minimum(d, R)
        n = tl.where(d < R, Q + 1, Q)
    return lo, n


@triton.jit
def shard_owner(c, HIDDEN: tl.constexpr, W: tl.constexpr):
    """The rank that owns output column ``c`` (inverse of :func:`shard_of`)."""
    Q: tl.constexpr = HIDDEN // W
    R: tl.constexpr = HIDDEN % W
    if R == 0:
        d = c // Q
    else:
        d = tl.where(c < R * (Q + 1), c // (Q + 1), R + (c - R * (Q + 1)) // tl.maximum(Q, 1))
    return d


@triton.jit(do_not_specialize=["record", "adv"])
def abort_kernel(ftab_ptr, fault_ptr, host_flag_ptr, record, adv, W: tl.constexpr):
    """The host's abort path (one program): post ``record`` into every rank's fault word (CAS
    from 0, as :func:`post_fault`) and set this rank's host mirror.  Launched by a rank that
    rejects its inputs, or that raised a fault, so that every peer's waits end (``k3tail.ops.fault``).
    The record names this rank's call (``fault_ptr``: its own fault block) plus ``adv``: 1 for a
    call rejected before its first launch (the device counter has not advanced for it).  It never
    waits."""
    record = with_call(record, fault_ptr, adv)
    for d in tl.static_range(W):
        peer = tl.load(ftab_ptr + d).to(tl.pointer_type(tl.int32))
        tl.atomic_cas(peer + 1, 0, record, sem="acq_rel", scope="sys")
    note_fault(host_flag_ptr)
