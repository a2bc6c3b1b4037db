"""Exceptions raised by k3tail.

A collective call either completes on every rank with every rank's data from that same call, or
fails on every rank (DESIGN §9).  The failure raises a :class:`PeerFault` on every rank; its
subclass says why, and its attributes say where:

* :class:`PeerTimeout` -- a peer never arrived before the deadline (``timeout_s``);
  :class:`WorkspacePoisoned` -- a call after a fault (it fails at once, never waits);
* :class:`PeerMismatch` -- a peer's call is another call (it skipped or rejected a call, or called
  with another M, or from another layer): the call tags or the group header differ;
* :class:`PeerRejected` -- a peer rejected its inputs (its ``ValueError``), or an ``expanded_idx``
  entry was out of range on the device;
* :class:`InputRejected` -- raised by the rank that rejected its inputs itself (also a
  ``ValueError``), after it told its peers.

Attributes of every :class:`PeerFault`: ``op``, ``rank``, ``world_size``, ``reason`` (``"timeout"``,
``"mismatch"``, ``"rejected"``, ``"index"``, ``"aborted"``, ``"poisoned"``), ``failing_rank`` (None
when unknown), ``detected_by``, ``layer`` (the module prefix) and ``tier`` (the tier name) when a
``K3MoETail`` raised it, and ``phase``: None for a call, else the host rendezvous of construction,
``k3tail.reset`` or the recovery that failed (``k3tail.runtime.comm``: every rank raises there).
After any :class:`PeerFault` of a call the group's modules fail every call until the documented
recovery (``k3tail.reset(group)`` on every rank, or rebuilding the modules; docs/integration.md).
"""

from __future__ import annotations

from typing import Optional

# fault record codes (triton_kernels/lamport.py)
REASONS = {1: "timeout", 2: "mismatch", 3: "rejected", 4: "index", 5: "aborted"}
NO_RANK = 255

RECOVERY = ("the group's k3tail calls fail until k3tail.reset(group) runs on every rank "
            "(or the modules are rebuilt on every rank)")
HOST_RECOVERY = ("every rank of the group raised this at the same rendezvous; once the peers are back, build "
                 "the modules again (or run k3tail.reset(group)) on every rank")


def decode_record(word: int) -> dict:
    """``{"code", "reason", "failing_rank", "detected_by", "call"}`` of a packed fault record (0:
    none); ``call`` is the poster's device call number mod 2^11 (``lamport``'s ``CTRL_CALL``)."""
    word = int(word)
    code = word & 0xF
    failing = (word >> 4) & 0xFF
    det = (word >> 12) & 0xFF
    return {"code": code, "reason": REASONS.get(code, "unknown"),
            "failing_rank": None if failing == NO_RANK else failing,
            "detected_by": None if det == NO_RANK else det, "call": (word >> 20) & 0x7FF}


def record_word(code: int, failing: Optional[int], detector: Optional[int]) -> int:
    """Host twin of ``lamport.fault_record`` (the call number, bits 20-30, is added on the device)."""
    f = NO_RANK if failing is None else int(failing)
    d = NO_RANK if detector is None else int(detector)
    return int(code) + (f & 0xFF) * 16 + (d & 0xFF) * 4096


def describe(reason: str, failing: Optional[int], detector: Optional[int], rank: int) -> str:
    """One sentence on what went wrong, from a decoded record, as seen by ``rank``."""
    who = f"rank {failing}" if failing is not None else "a peer"
    by = "" if detector is None or detector == rank else f" (reported by rank {detector})"
    text = {
        "timeout": f"{who} never arrived before the deadline",
        "mismatch": f"{who} made another call (it skipped or rejected a call, or called with another M or "
                    f"from another layer): the call tags differ",
        "rejected": f"{who} rejected its inputs (it raised ValueError)",
        "index": f"{who}'s expanded_idx holds an index outside [-1, rows of expert_out)",
        "aborted": f"{who} failed in another call of this group",
    }.get(reason, f"fault record {reason!r}")
    return text + by


class K3TailError(RuntimeError):
    """Base class of every k3tail error."""


class PeerFault(K3TailError):
    """A collective call failed on every rank (see the module docstring)."""

    default_reason = "aborted"

    def __init__(self, op: str, rank: int, world_size: int, detail: str = "", *, reason: Optional[str] = None,
                 failing_rank: Optional[int] = None, detected_by: Optional[int] = None,
                 layer: Optional[str] = None, tier: Optional[str] = None, waited_s: Optional[float] = None,
                 text: Optional[str] = None, phase: Optional[str] = None):
        self.op, self.rank, self.world_size = op, rank, world_size
        self.phase = phase
        self.reason = reason or self.default_reason
        self.failing_rank, self.detected_by = failing_rank, detected_by
        self.layer, self.tier, self.waited_s, self.detail = layer, tier, waited_s, detail
        self._text = text
        super().__init__(self._message())

    def _what(self) -> str:
        return self._text or describe(self.reason, self.failing_rank, self.detected_by, self.rank)

    def _message(self) -> str:
        where = ""
        if self.layer is not None:
            where = f"layer {self.layer!r}" + (f", tier {self.tier}" if self.tier else "") + ": "
        msg = f"{where}{self.op}: rank {self.rank} of world size {self.world_size}: {self._what()}"
        if self.detail:
            msg += f" ({self.detail})"
        return msg + f"; {RECOVERY if self.phase is None else HOST_RECOVERY}"

    def in_call(self, *, layer: str, tier: Optional[str]) -> "PeerFault":
        """The same error, naming the module's layer and the call's tier (K3MoETail re-raises it)."""
        e = type(self).__new__(type(self))
        e.__dict__.update(self.__dict__)
        e.layer, e.tier = layer, tier
        Exception.__init__(e, e._message())
        return e


class PeerTimeout(PeerFault):
    """A peer never arrived: a bounded wait passed its deadline; the group's waits are ended."""

    default_reason = "timeout"

    def __init__(self, op: str, rank: int, world_size: int, waited_s: float = 0.0, detail: str = "", **kw):
        kw.setdefault("waited_s", waited_s)
        super().__init__(op, rank, world_size, detail, **kw)

    def _what(self) -> str:
        if self._text:
            return self._text
        if self.reason == "timeout" and self.waited_s:
            if self.failing_rank == self.rank and self.detected_by not in (None, self.rank):
                return (f"rank {self.detected_by} waited {self.waited_s:.1f} s for this rank, which did not arrive "
                        f"before the deadline")
            who = f"rank {self.failing_rank}" if self.failing_rank is not None else "a peer"
            by = "" if self.detected_by in (None, self.rank) else f" (rank {self.detected_by} waited)"
            return f"waited {self.waited_s:.1f} s for {who} that never arrived{by}"
        return super()._what()


class WorkspacePoisoned(PeerTimeout):
    """A call after a fault (an earlier wait timed out, or a peer posted a fault): fails at once."""

    def _what(self) -> str:
        base = PeerFault._what(self) if self.reason != "poisoned" else "an earlier call failed"
        return f"fails at once: an earlier fault ({base})"

    def as_found(self) -> PeerFault:
        """The same record as the error of its reason (what ``fault_error(..., before=False)`` gives):
        for a fault that rose *during* a call whose start check had passed, met first by a later step
        of that call (on a GPU a kernel posts an index fault while the host still launches the call's
        next op, whose start check then sees the fault flag)."""
        cls = _REASON_CLASS.get(self.reason, PeerFault)
        e = cls.__new__(cls)
        e.__dict__.update(self.__dict__)
        Exception.__init__(e, e._message())
        return e


class PeerMismatch(PeerFault):
    """A peer's call is another call: the call tags (Lamport tiers) or the group header differ."""

    default_reason = "mismatch"


class PeerRejected(PeerFault):
    """A peer rejected its inputs, or an ``expanded_idx`` entry was out of range on the device."""

    default_reason = "rejected"


class InputRejected(PeerFault, ValueError):
    """This rank rejected its inputs (the ``ValueError`` text is in the message) after telling its
    peers, so that they fail too instead of pairing with this rank's next call."""

    default_reason = "rejected"


class TierUnavailable(K3TailError):
    """A forced tier that the capability vote did not make possible."""


def fault_error(op: str, rank: int, world_size: int, word: int, *, waited_s: float = 0.0, detail: str = "",
                before: bool = False) -> PeerFault:
    """The error for fault record ``word`` seen by ``rank``: :class:`WorkspacePoisoned` when the fault
    was already known before the call (``before``), else the class of the record's reason."""
    rec = decode_record(word)
    kw = dict(reason=rec["reason"] if word else "poisoned", failing_rank=rec["failing_rank"],
              detected_by=rec["detected_by"])
    if before:
        return WorkspacePoisoned(op, rank, world_size, waited_s, detail, **kw)
    if rec["reason"] == "timeout":
        return PeerTimeout(op, rank, world_size, waited_s, detail, **kw)
    return _REASON_CLASS.get(rec["reason"], PeerFault)(op, rank, world_size, detail, **kw)


# the error class of a fault record's reason (a fault met by the call that raises it)
_REASON_CLASS = {"timeout": PeerTimeout, "mismatch": PeerMismatch, "rejected": PeerRejected, "index": PeerRejected}
