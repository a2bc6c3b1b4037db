"""The capability vote's functional P2P probe: one write through the peer table, nothing polled.

Buffers: the probe workspace holds, per rank, ``W`` int32 slots of ``SLOT`` words, armed with the
32-bit sentinel.  Who writes what: rank s's single program stores the pattern
``s * 65536 + d * 256 + i + 1`` (word i) into slot s of every rank d's region, remote plain stores.
Nobody polls, so the kernel cannot spin or hang: the host synchronizes its device and meets the
group at a barrier, then each rank reads its own region and checks that every slot holds its
producer's pattern (a slot still armed, or holding anything else, means the driver dropped a write
it reported as P2P).  Nobody re-arms: the workspace is used once and dropped.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rank"])
def p2p_probe_kernel(table_ptr, rank, W: tl.constexpr, SLOT: tl.constexpr):
    offs = tl.arange(0, SLOT)
    for d in tl.static_range(W):
        peer = tl.load(table_ptr + d).to(tl.pointer_type(tl.int32))
        tl.store(peer + rank * SLOT + offs, rank * 65536 + d * 256 + offs + 1)
