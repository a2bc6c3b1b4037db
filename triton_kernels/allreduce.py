"""One-shot Lamport all-reduce (sum) over a peer pointer table.

Buffers (per rank, identical layout; see ``lamport.py`` for the slot protocol)::

    data[stage][src][token][width]   dtype, NUM_STAGES x W x max_tokens x width
    tags[stage][src][token][CHUNKS]  int32 at byte TAG_OFF: the call tag of each published chunk

Who writes what.  Work item (token t, chunk c) is owned by one program on every rank.
That program canonicalizes its chunk of ``x[t]`` and stores it into slot
``data[stage][rank][t][chunk]`` of *every* rank (itself included), and the call's ``tag`` into
``tags[stage][rank][t][chunk]``; it publishes all its items first.  It then polls its local
``data[stage][0..W-1][t][chunk]`` together with the W tag slots of the chunk (one loop), checks
that every source's tag is its own (another tag: a MISMATCH fault, nothing is summed), sums the W rows
in rank order in fp64 (``numerics.py``: the fp32 result then does not depend on the order
of the sum, so an fp32 all-reduce here gives the bits the fused kernels give), rounds to
fp32 (and from there to a 16-bit dtype), writes ``out[t][chunk]`` and re-arms the slots and
tag slots it read (it is their only reader; the re-arm follows a CTA barrier, see ``lamport.py``).

Faults (``lamport.py``): a wait ends at the deadline (TIMEOUT, naming the first source still
armed) or when the fault word is set; a launch that finds the fault word set, or the caller's
``status`` word non-zero (an index out of range found by the finalize that produced ``x``:
INDEX, naming this rank), publishes nothing.  Either way every rank's waits end.

Who re-arms what, and why it cannot race.  The consumer re-arms; ``stage`` rotates over
3 slot sets on the device-side counter in the control block (advanced by the last
program of the launch), so a producer's next write into a slot set comes at least one
whole call after every rank re-armed it (``lamport.py`` gives the argument).  All ranks
must launch the kernels of one workspace in the same order.

Programs are persistent (grid-stride over work items) so the grid can be capped to what
is co-resident; work item i is handled by program i % P on every rank, so the
interpreter (which runs programs one after another) cannot deadlock either: program p
only waits for items that the peers' program p handles in the same order.
"""

import triton
import triton.language as tl

from .lamport import (arm, await_slots, canonicalize, finish_launch, now_ns, peer_ptr, rearm, region_ptr, round_to,
                      start_gate)
from .numerics import rank_sum64


@triton.jit(do_not_specialize=["rank", "M", "timeout_ns", "tag"])
def oneshot_allreduce_kernel(
    x_ptr, out_ptr, table_ptr, ctrl_ptr, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr, status_ptr,
    rank, M, timeout_ns, tag,
    WIDTH: tl.constexpr, MAX_TOKENS: tl.constexpr, W: tl.constexpr, W_P2: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr, TAG_OFF: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (and its stage bump) are visible
    start = now_ns(clock_ptr, USE_GLOBALTIMER)
    deadline = start + timeout_ns
    stage = tl.load(ctrl_ptr + 0, volatile=True)
    CHUNKS: tl.constexpr = (WIDTH + BLOCK - 1) // BLOCK
    SLOT: tl.constexpr = MAX_TOKENS * WIDTH          # one source's slot set in a stage
    STAGE_ELEMS: tl.constexpr = W * SLOT
    DTYPE = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    srcs = tl.arange(0, W_P2)
    smask = srcs < W
    my_base = peer_ptr(table_ptr, rank, DTYPE)
    my_tags = region_ptr(table_ptr, rank, TAG_OFF, tl.int32)
    n_items = M * CHUNKS
    # the finalize that produced x may have met an index out of range (status): then publish nothing
    if start_gate(fault_ptr, ftab_ptr, host_flag_ptr, status_ptr, tag, rank, W):
        # Phase 1: publish every item this program owns (stores are fire-and-forget, so
        # the polls of phase 2 overlap with the peers' pushes).  Program p of every rank
        # owns the same items, so under the interpreter program p only waits for what the
        # peers' program p published in its own phase 1.
        item = pid
        while item < n_items:
            t = item // CHUNKS
            c = item % CHUNKS
            col = c * BLOCK + offs
            cmask = col < WIDTH
            x = canonicalize(tl.load(x_ptr + t * WIDTH + col, mask=cmask, other=0.0))
            slot_off = stage * STAGE_ELEMS + rank * SLOT + t * WIDTH
            tag_off = ((stage * W + rank) * MAX_TOKENS + t) * CHUNKS + c
            for d in tl.static_range(W):
                tl.store(peer_ptr(table_ptr, d, DTYPE) + slot_off + col, x, mask=cmask)
                tl.store(region_ptr(table_ptr, d, TAG_OFF, tl.int32) + tag_off, tag)
            item += nprog
        # Phase 2: poll the local slots and tags of all W sources, check the tags, sum in rank
        # order, re-arm.
        item = pid
        while item < n_items:
            t = item // CHUNKS
            c = item % CHUNKS
            col = c * BLOCK + offs
            cmask = col < WIDTH
            rows = stage * STAGE_ELEMS + srcs[:, None] * SLOT + t * WIDTH + col[None, :]
            rmask = smask[:, None] & cmask[None, :]
            tptrs = my_tags + ((stage * W + srcs) * MAX_TOKENS + t) * CHUNKS + c
            if await_slots(my_base + rows, rmask, tptrs, smask, tag, fault_ptr, ftab_ptr, host_flag_ptr, clock_ptr,
                           deadline, rank, W, USE_GLOBALTIMER):
                acc = rank_sum64(my_base + stage * STAGE_ELEMS + t * WIDTH + col, SLOT, cmask, W)
                tl.store(out_ptr + t * WIDTH + col, round_to(acc.to(tl.float32), DTYPE), mask=cmask)
                rearm(my_base + rows, rmask, DTYPE)  # barrier first: every thread has read
                arm(tptrs, smask, tl.int32)          # (after the same barrier)
            item += nprog
    finish_launch(ctrl_ptr, nprog, NUM_STAGES)
