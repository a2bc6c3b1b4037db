"""Lamport slot primitives shared by every k3tail collective.

Protocol
========
Buffers.  Every rank owns one symmetric region (same layout on every rank) that peers
address through an int64 *peer table* of base pointers (``table[d]`` = rank d's region).
A region is carved into *slots*; a slot holds one fragment of one producer's data for
one consumer (the owner of the region).

Sentinel.  A slot element is *armed* when it holds the bit pattern of -0.0 of the slot's
type: 0x8000 for bf16/fp16 slots, 0x80000000 for fp32 slots (fp32 payloads carry partial
sums that the rounding contract forbids rounding to 16 bits before they are added).  Real data never equals the sentinel because every writer
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

Bounded waits.  Every poll carries a deadline.  On the GPU the clock is the device
global timer (ns).  Under the Triton interpreter (``TRITON_INTERPRET=1``) inline asm is
unavailable, so the clock is a *clock page*: an int64 that a host thread of the process
refreshes with ``time.monotonic_ns()`` (see ``k3tail._clock``).  A poll that passes its
deadline sets the poison flag of the local control block (and of its host mirror) and
gives up; every later poll and every later launch sees the flag and exits at once, so a
poisoned workspace never hangs a rank.  The host raises ``PeerTimeout``.

Control block (int32, local to each rank, never touched by peers)::

    [CTRL_STAGE]   stage counter, advanced by the last program of each launch
    [CTRL_POISON]  0 = healthy, 1 = a wait timed out
    [CTRL_DONE]    programs of the current launch that finished (last one resets it)
    [CTRL_USER..]  per-op state (e.g. rows used per stage for deferred re-arm)
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
CTRL_WORDS = 16


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
def peer_ptr(table_ptr, rank, DTYPE: tl.constexpr):
    """Base pointer of ``rank``'s region from the peer table, typed ``DTYPE``.  Region bases
    are at least 16-byte aligned (page-aligned allocations); telling the compiler lets it
    vectorize the remote stores and local polls."""
    base = tl.multiple_of(tl.load(table_ptr + rank), 16)
    return base.to(tl.pointer_type(DTYPE))


@triton.jit
def now_ns(clock_ptr, USE_GLOBALTIMER: tl.constexpr):
    """Current time in ns: device global timer, or the host clock page (interpreter)."""
    if USE_GLOBALTIMER:
        t = tl.extra.cuda.globaltimer()
    else:
        t = tl.load(clock_ptr, volatile=True)
    return t


@triton.jit
def is_poisoned(ctrl_ptr):
    return tl.load(ctrl_ptr + 1, volatile=True) != 0


@triton.jit
def poison(ctrl_ptr, host_flag_ptr):
    """Mark the workspace dead (device block and its host mirror)."""
    tl.atomic_xchg(ctrl_ptr + 1, 1)
    tl.atomic_xchg(host_flag_ptr, 1)


@triton.jit
def wait_ready(ptrs, mask, ctrl_ptr, host_flag_ptr, clock_ptr, deadline,
               USE_GLOBALTIMER: tl.constexpr):
    """Spin on local slots ``ptrs`` until no masked element is the sentinel.

    Returns 1 when the data is there, 0 when the deadline passed or the workspace is
    poisoned (then the poison flag is set).  The loop carries only a scalar (a tensor
    loop-carry with a reduction condition crashed the Triton 3.6 compiler); callers
    load the data again after the loop.
    """
    state = 1  # 1 pending, 0 ready, -1 gave up
    while state > 0:
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        n_armed = tl.sum((is_armed(v) & mask).to(tl.int32))
        dead = is_poisoned(ctrl_ptr) | (now_ns(clock_ptr, USE_GLOBALTIMER) > deadline)
        state = tl.where(n_armed == 0, 0, tl.where(dead, -1, 1))
    if state < 0:
        poison(ctrl_ptr, host_flag_ptr)
    return state == 0


@triton.jit
def finish_launch(ctrl_ptr, num_programs, NUM_STAGES_: tl.constexpr):
    """Called once by every program at its end: the last one advances the stage."""
    old = tl.atomic_add(ctrl_ptr + 2, 1)
    if old == num_programs - 1:
        tl.store(ctrl_ptr + 2, 0)
        stage = tl.load(ctrl_ptr + 0, volatile=True)
        tl.store(ctrl_ptr + 0, (stage + 1) % NUM_STAGES_)
