"""Host-side collectives of construction (vote, rendezvous, barrier): the :class:`Comm`
interface and its ``torch.distributed`` implementation (:class:`DistComm`).  The other
kinds of world implement it too: ``k3tail.runtime.loopback.LoopbackGroup`` (W virtual ranks in one
process) and ``k3tail.vote.SoloComm`` (a world of one).  Re-exported by
``k3tail.runtime.workspace``."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from k3tail.errors import K3TailError

__all__ = ["Comm", "DistComm", "SoloComm", "comm_for"]


class Comm:
    """The few host-side collectives construction needs (vote, rendezvous, barrier)."""

    rank: int
    world_size: int

    def all_reduce_min(self, values: Sequence[int]) -> List[int]:
        raise NotImplementedError

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class SoloComm(Comm):
    """A world of one (``k3tail doctor`` without a process group, or W = 1)."""

    rank, world_size, name, backend = 0, 1, "solo", "solo"

    def all_reduce_min(self, values):
        return [int(v) for v in values]

    def broadcast_object(self, obj, src=0):
        return obj

    def barrier(self):
        pass


class DistComm(Comm):
    """A ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if not dist.is_initialized():
            raise K3TailError("torch.distributed is not initialized: call init_process_group "
                              "first, or pass a LoopbackWorld group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.name = getattr(group, "group_name", None) if group is not None else dist.group.WORLD.group_name

    def _device(self) -> torch.device:
        """Where this group's own collectives put their tensors (NCCL: CUDA; gloo: CPU)."""
        if "nccl" in str(self.backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_min(self, values):
        t = torch.tensor(list(values), dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.cpu()]

    def broadcast_object(self, obj, src=0):
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src)
                                   if self.group is not None else src, group=self.group)
        return box[0]

    def barrier(self):
        if self.backend == "nccl":
            self.all_reduce_min([0])
        else:
            dist.barrier(group=self.group)


def comm_for(group) -> Comm:
    """The :class:`Comm` for a ``group=`` argument (None = the default process group)."""
    if isinstance(group, Comm):
        return group
    return DistComm(group)
