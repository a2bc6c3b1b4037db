"""Peer exchange for the large-M tail (DESIGN §3.4 steps 2, 4, 5): a flag barrier and a pull.

No Lamport slots here: the data areas carry plain values (any bit pattern, -0.0 included) and
readiness is signalled separately by per-source epoch flags.  Host side: ``k3tail/exchange.py``.

Buffers (per rank, identical layout; ``table[d]`` = base of rank d's region)::

    flag[W]        int64 ``(tag << 32) | epoch``, at offset 0 of the region; flag[s] of rank d is
                   written only by rank s (atomic, release), read only by rank d (volatile polls,
                   then acquire)
    area_0 ...     named data areas, 256-byte aligned; area X of rank o is written only by rank o
                   (ordinary kernels on o's stream) and read by every rank (gather_cols_kernel)

Control block (``lamport.py``): ``ctrl[CTRL_EPOCH]`` is this rank's barrier epoch, a
device-side counter (a CUDA-graph replay advances it; a host counter would freeze at capture);
the fault word is in the fault block (``fault_ptr``; the group's, for a K3MoETail).

barrier_kernel (one program).  ``e = ++ctrl[CTRL_EPOCH]``; store ``(tag << 32) | e`` into
``flag[rank]`` of every rank (``atomic_xchg``, sem release, scope sys: the writes of the earlier
kernels of this stream are complete at the kernel boundary and are ordered before the flag by the
release); then poll the *local* ``flag[0..W-1]`` with volatile loads until every epoch has reached
``e``, compared by the wrap-safe signed difference ``flag - e >= 0`` (a peer may already be one
epoch ahead: it passed barrier e, which needed our flag e, and stored e+1; it cannot be two ahead,
since barrier e+1 needs our e+1), then an acquire read-modify-write (``atomic_add 0``) of the
flags orders the reads of the following kernels after the peers' releases.  A peer's memory is
never polled.  The wait is bounded: past ``timeout_ns`` (global timer; the clock page under the
interpreter) the rank posts a TIMEOUT record naming the first peer behind; when the fault word is
set it exits (``lamport.py``); the host raises.

One call, one pairing: the flag carries the caller's call tag next to the epoch.  Every peer whose
flag holds exactly epoch ``e`` must hold this rank's tag (another tag: a MISMATCH fault); a peer
already at ``e + 1`` passed barrier ``e`` itself and compared our tag there, so every pair of ranks
is compared by at least one of them.  A rank whose ``status`` word is non-zero (the large-M
finalize met an index out of range) posts an INDEX fault instead of arriving.

gather_cols_kernel.  For every source s, copy s's row-major block ``[M, n_s]`` (``n_s =
bounds[s+1] - bounds[s]``) at the start of its area into ``out[:, bounds[s]:bounds[s+1]]`` with
volatile loads (no stale L1 line of an earlier version).  It never waits: the barrier before it
made the data complete.  Tiles of all sources are dealt round-robin to the programs.

Reuse protocol (why nothing can race; no trailing barrier is needed).  Every rank issues the
same sequence of barriers (a rank-uniform program order, like the workspace sharing rule); they
are numbered by epoch e = 1, 2, ... across calls, and *segment* e is what a rank's stream runs
between passing barrier e and launching barrier e+1 (segment 0: before barrier 1).  Rank s
launches barrier e only after finishing segment e-1 (stream order), and every rank passes
barrier e only after every rank launched it.  Rule: **a version of area X written by its owner
in segment w may be read by peers in segments j with w < j < w', where w' is the segment of the
owner's next write of X.**
  * Read after write: the reader passes barrier j >= w+1 only after the owner launched barrier
    w+1, i.e. after its write of segment w completed (release/acquire through flag[owner]).
  * Write after read: the owner writes again in segment w' >= j+1, i.e. after passing barrier
    w', which needs every reader's flag w'; a reader stores it only after finishing segment
    j < w', its reads included.
The large-M tail's call c runs barriers B1..B4 at epochs 4c+1..4c+4:
    seg 4c   : write routed+shared areas          (and gather the outputs of call c-1)
    seg 4c+1 : pull+sum peers' routed/shared;  write own stats area
    seg 4c+2 : read all stats;                 write own normed area
    seg 4c+3 : gather normed;                  write own output area
    seg 4c+4 : gather outputs                  (= seg 4(c+1): next call's routed/shared writes)
  routed/shared: written 4c, read 4c+1, rewritten 4c+4;  stats: 4c+1 < 4c+2 < 4c+5;
  normed: 4c+2 < 4c+3 < 4c+6;  output: 4c+3 < 4c+4 < 4c+7.  Every area satisfies w < j < w',
  across calls too: the output area of call c is rewritten only in segment 4c+7 (after call c+1's
  B3), which every peer enters only after its segment 4c+4, where it gathered call c's outputs.
  Segment 4c+4 holds the output gather of call c and the routed/shared writes of call c+1: they
  touch different areas.

Grid.  Spinning grids must be co-resident: the barrier is one program per rank, which every
cap allows (in loopback W virtual ranks spin on W SMs at most).  The gather does not spin.
Torch twins: ``k3tail.exchange.reference_gather_cols`` (the gather); the barrier moves no data.
"""

import triton
import triton.language as tl

from .lamport import NO_RANK_C, cta_any, fault_record, is_poisoned, note_fault, now_ns, peer_ptr, post_fault, start_gate

CTRL_EPOCH = 4  # lamport.CTRL_USER: this rank's barrier epoch


@triton.jit
def area_ptr(table_ptr, rank, DTYPE: tl.constexpr):
    """``rank``'s area base from the area's peer table, typed ``DTYPE``, with its alignment
    (256 bytes, 16 claimed) stated on the *pointer*: the hint on the int64 before the cast
    (``lamport.peer_ptr``) left the gather's loads scalar (b16) in the sm_90 PTX; after the
    cast they are ``ld.volatile.global.v4.b32``."""
    return tl.multiple_of(tl.load(table_ptr + rank).to(tl.pointer_type(DTYPE)), 16)


@triton.jit(do_not_specialize=["rank", "timeout_ns", "tag"])
def barrier_kernel(table_ptr, ctrl_ptr, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr, status_ptr, rank, timeout_ns,
                   tag, W: tl.constexpr, W_P2: tl.constexpr, CTRL_EPOCH_: tl.constexpr,
                   USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are complete and visible
    # the finalize before this barrier may have met an index out of range (status): then post INDEX
    if start_gate(fault_ptr, ftab_ptr, host_flag_ptr, status_ptr, tag, rank, W):
        deadline = now_ns(clock_ptr, USE_GLOBALTIMER) + timeout_ns
        epoch = tl.load(ctrl_ptr + CTRL_EPOCH_, volatile=True) + 1
        tl.store(ctrl_ptr + CTRL_EPOCH_, epoch)
        word = (tag.to(tl.int64) << 32) | (epoch.to(tl.int64) & 0xFFFFFFFF)
        for d in tl.static_range(W):  # arrive: flag[rank] of every rank (release: our writes first)
            tl.atomic_xchg(peer_ptr(table_ptr, d, tl.int64) + rank, word, sem="release", scope="sys")
        srcs = tl.arange(0, W_P2)
        smask = srcs < W
        mine = peer_ptr(table_ptr, rank, tl.int64) + srcs  # the local flags only
        # The loop carries only a scalar (TRITON_NOTES 1); signed 32-bit difference: wrap-safe.
        state = 3  # 3 pending, 0 passed, 1 deadline, 2 fault word set
        while state > 2:  # every branch a CTA-wide vote: the warps' copies of the flags may differ (lamport.py)
            v = tl.load(mine, mask=smask, other=0, volatile=True)
            behind = cta_any(tl.sum(((v.to(tl.int32) - epoch < 0) & smask).to(tl.int32)) > 0)
            poisoned = cta_any(is_poisoned(fault_ptr))
            late = cta_any(now_ns(clock_ptr, USE_GLOBALTIMER) > deadline)
            state = tl.where(behind, tl.where(poisoned, 2, tl.where(late, 1, 3)), 0)
        if state == 0:
            tl.atomic_add(mine, 0, mask=smask, sem="acquire", scope="sys")  # peers' releases -> our reads
            v = tl.load(mine, mask=smask, other=0, volatile=True)
            lo = v.to(tl.int32)
            hi = (v >> 32).to(tl.int32)
            wrong = smask & (lo == epoch) & (hi != tag)
            bad = tl.min(tl.where(wrong, srcs, NO_RANK_C))
            if bad < NO_RANK_C:
                got = tl.max(tl.where(srcs == bad, hi, -1))
                post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(2, bad, rank), tag, got, W)
        elif state == 1:
            v = tl.load(mine, mask=smask, other=0, volatile=True)
            late_src = tl.min(tl.where(smask & (v.to(tl.int32) - epoch < 0), srcs, NO_RANK_C))
            post_fault(ftab_ptr, fault_ptr, host_flag_ptr, fault_record(1, late_src, rank), tag, -1, W)
        else:
            note_fault(host_flag_ptr)


@triton.jit(do_not_specialize=["M", "out_stride"])
def gather_cols_kernel(out_ptr, table_ptr, bounds_ptr, fault_ptr, M, out_stride,
                       W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ALIGN: tl.constexpr, USE_PDL: tl.constexpr):
    """``out[:, bounds[s]:bounds[s+1]] = area_s[M, n_s]`` for every source s; ``table_ptr`` is
    the area's peer table (256-byte aligned bases).  ``ALIGN`` (host: a power of two dividing
    every width and ``out_stride``, at most 16 bytes) lets the loads and stores vectorize."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the barrier before us has passed
    DTYPE = out_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    if not is_poisoned(fault_ptr):
        row_tiles = tl.cdiv(M, BLOCK_M)
        # ALIGN divides the stride (host): say so by arithmetic, exact here.  ``tl.multiple_of``
        # on a scalar kernel argument is dropped (it has no defining op to carry the hint).
        stride = out_stride // ALIGN * ALIGN
        first = pid * 0  # global index of source s's first tile
        s = 0
        while s < W:
            lo = tl.multiple_of(tl.load(bounds_ptr + s), ALIGN)
            n = tl.multiple_of(tl.load(bounds_ptr + s + 1) - lo, ALIGN)
            col_tiles = tl.cdiv(n, BLOCK_N)
            n_tiles = row_tiles * col_tiles
            src = area_ptr(table_ptr, s, DTYPE)
            i = (pid - first % nprog + nprog) % nprog  # this program's first tile of source s
            while i < n_tiles:
                r = ((i // col_tiles) * BLOCK_M + rows).to(tl.int64)
                c = (i % col_tiles) * BLOCK_N + cols
                m = (r[:, None] < M) & (c[None, :] < n)
                x = tl.load(src + r[:, None] * n + c[None, :], mask=m, volatile=True)
                tl.store(out_ptr + r[:, None] * stride + (lo + c)[None, :], x, mask=m)
                i += nprog
            first += n_tiles
            s += 1
