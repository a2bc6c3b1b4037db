"""Host side of the call protocol (DESIGN §9; kernels: ``triton_kernels/lamport.py``).

* :func:`call_tag` -- the tag a call carries in its Lamport slots (the same on every rank for the same call);
* :class:`CallCounter` -- a standalone op's own call sequence (``K3MoETail`` passes its group's tag instead);
* :func:`post_abort` -- the abort path: post a fault record into every rank's fault word (a tiny kernel);
* :func:`count_own_call` -- a standalone op's call counted on the device (the number its fault records carry).

Calls are also counted on the device (``Workspace.advance_call``), for one purpose only: a fault
record names the call it belongs to, so that a peer still finishing an earlier call is not stopped
by it (``triton_kernels/lamport.py``).  Tags stay host values, for the reason below.

Why a tag is never a device counter: a rank that skipped a call has launched exactly as many
kernels as one that did not launch it either, so only the host can tell calls apart.  The tag
is a runtime kernel argument; a CUDA graph captures it as a constant (every rank captures the
same), so graph replays are told apart by the deadlines, not by tags.
"""

from __future__ import annotations

from typing import Optional

import torch

from k3tail.errors import record_word
from k3tail.runtime import launch as L
from k3tail.runtime.modes import warm_only_active
from k3tail.runtime.workspace import Workspace
from k3tail.triton_kernels.lamport import abort_kernel

__all__ = ["CallCounter", "call_tag", "layer_salt", "post_abort", "warm_abort"]

_ABORT = L.kernel(abort_kernel)
_SEQ_BITS, _M_BITS = 17, 14


def _mix(v: int, offset: int) -> int:
    """A 31-bit pseudo-random hash of ``v`` (a murmur3 finalizer of ``v * golden + offset``); 0 for v = 0.
    Two offsets give two independent hash functions (two domains)."""
    x = (int(v) * 0x9E3779B1 + offset) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x ^= x >> 16
    return x & 0x7FFFFFFF if v else 0


def layer_salt(layer_id: int) -> int:
    """A 31-bit pseudo-random salt of a layer id (a murmur3 finalizer): tags of two layers differ
    unless their (sequence, M) parts happen to differ by exactly the salts' difference (2^-31)."""
    return _mix(layer_id, 0x7F4A7C15)


def _high_m_salt(high: int) -> int:
    """The salt of M's bits above the tag's 14 (M >= 2^14): a hash of its own domain, not
    :func:`layer_salt`.  With one function for both, layer X at high part k1 and layer Y at high part
    k2 got equal tags whenever X = k2 and Y = k1 (the XORs cancel), so two different calls could pair
    on a kind whose only pairing check is the tag.  0 for M < 2^14 (those tags are unchanged)."""
    return _mix(high, 0x2545F491)


def call_tag(seq: int, M: int, salt: int = 0) -> int:
    """``(((seq mod 2^17) << 14) | (M mod 2^14)) ^ salt``, a non-negative int32 (never the 32-bit
    sentinel 0x80000000).  Two calls of the same layer get equal tags only if their sequence numbers
    differ by a multiple of 2^17 and their M by a multiple of 2^14 (then M's bits above 14 are salted
    too: :func:`_high_m_salt`); calls of two layers (salts) only by a 2^-31 coincidence."""
    base = ((int(seq) & ((1 << _SEQ_BITS) - 1)) << _M_BITS) | (int(M) & ((1 << _M_BITS) - 1))
    return (base ^ int(salt) ^ _high_m_salt(int(M) >> _M_BITS)) & 0x7FFFFFFF


class CallCounter:
    """A standalone op's call sequence: ``next(M)`` advances on every call, rejected ones included
    (a rank that rejected call n and then makes call n+1 must not pair with a peer's call n)."""

    def __init__(self):
        self.seq = 0

    def next(self, M: int) -> int:
        if warm_only_active():
            return call_tag(self.seq, M)
        self.seq += 1
        return call_tag(self.seq, M)


def count_own_call(ws: Optional[Workspace], tag: Optional[int], M: int = 1) -> None:
    """A standalone op called without a tag owns its call: count it on the device
    (``Workspace.advance_call``), so that its fault records name their call.  Not counted: a call
    whose tag the caller passes (``K3MoETail`` counts its own calls), a call with M = 0 (it launches
    nothing; ``K3MoETail`` does not count one either), and a world of one (no peer reads a record)."""
    if tag is None and M > 0 and ws is not None and ws.world_size > 1:
        ws.advance_call()


def post_abort(ws: Workspace, code: int, failing: int, detector: int, *, next_call: bool = False) -> None:
    """Post the fault record ``(code, failing, detector)`` into every rank's fault word of ``ws``'s
    fault block, and set this rank's host mirror: the peers' waits end, and their next launch on
    any workspace bound to that block does nothing.  The record names this rank's current call on
    the device, or the next one with ``next_call`` (a call rejected before it advanced the counter,
    ``Workspace.advance_call``): a peer still finishing an earlier call finishes it first
    (``triton_kernels/lamport.py``, "A fault record names its call").  A no-op inside CUDA-graph
    capture (nothing runs there) and in a warm-up pass."""
    if warm_only_active():
        return
    if ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    owner = ws.fault_owner
    # on the current stream, after this rank's earlier work (never waits: it only stores)
    _ABORT.variant(W=owner.world_size, num_warps=1)((1,), owner.ftab, owner.ctrl, owner.host_flag,
                                                    record_word(code, failing, detector), int(next_call))


def warm_abort(ws: Workspace) -> None:
    """Compile and load the abort kernel for ``ws``'s world size now (a GPU module load while a
    peer's kernel spins can hang the process, TRITON_NOTES 2: the abort path runs exactly then)."""
    from k3tail.runtime.modes import warm_only

    owner = ws.fault_owner
    with warm_only():
        _ABORT.variant(W=owner.world_size, num_warps=1)((1,), owner.ftab, owner.ctrl, owner.host_flag, 0, 0)
