"""Exceptions raised by k3tail."""


class K3TailError(RuntimeError):
    """Base class of every k3tail error."""


class PeerTimeout(K3TailError):
    """A peer never arrived: a bounded wait passed its deadline and poisoned the workspace."""

    def __init__(self, op: str, rank: int, world_size: int, waited_s: float, detail: str = ""):
        self.op, self.rank, self.world_size, self.waited_s = op, rank, world_size, waited_s
        msg = (f"{op}: rank {rank} of world size {world_size} waited {waited_s:.1f} s for a peer "
               f"that never arrived; the workspace is poisoned and every later call on it fails")
        super().__init__(msg + (f" ({detail})" if detail else ""))


class WorkspacePoisoned(PeerTimeout):
    """A call on a workspace that an earlier timeout poisoned (fails at once, never waits)."""


class TierUnavailable(K3TailError):
    """A forced tier that the capability vote did not make possible."""
