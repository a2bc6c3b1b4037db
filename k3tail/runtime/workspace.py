"""Symmetric workspaces: one interface, three backends (DESIGN §5).

A :class:`Workspace` gives a kernel everything it needs to reach its peers:

* ``table``     int64 tensor ``[W]`` on the kernel's device, ``table[d]`` = base address of
                rank d's region (the same layout on every rank);
* ``ctrl``      int32 control block ``[CTRL_WORDS]`` of this rank (stage counter, fault word,
                launch counter, per-op words), see ``triton_kernels/lamport.py``.  It lives in
                the rank's region, after the data (``ctrl_off``), so peers can post a fault
                record into its fault word; nothing else in it is touched by peers;
* ``fault_blk`` the fault block the kernels check and post into: ``ctrl`` itself, or, after
                :meth:`Workspace.bind_fault`, the group's shared block (a ``K3MoETail``'s ops
                share one per group, so a fault anywhere ends every wait of the group);
* ``ftab``      int64 ``[W]``: every rank's address of that fault block (the peers' fault words);
* ``host_flag`` int32 ``[1]`` host-visible mirror of the fault word (pinned on CUDA), so
                the host can fail fast without synchronizing (the block's owner's);
* ``multicast_ptr`` the multicast address, or 0 (always 0 on this project's machines);
* ``rank``, ``world_size``, ``device``, ``nbytes`` (per-rank region size), ``backend``.

Backends:

``symm_mem``  CUDA, ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``).
``shm``       CPU processes: one shared-memory segment under /dev/shm mapped by every rank
              process (each builds its table from its own mapping); kernels run under
              ``TRITON_INTERPRET=1``.  The file is unlinked as soon as every rank mapped it.
``loopback``  W virtual ranks in one process on one GPU, each on its own stream, all
              sharing one table (:class:`LoopbackWorld`).

Allocation and rendezvous happen only at construction (never inside CUDA-graph capture:
that raises).  Regions are armed with the sentinel (and the control block zeroed) before the
closing barrier, so no peer can write before its slot is armed.  :meth:`Workspace.rearm` arms
the region and zeroes the control block again, in place: the recovery after a fault
(``k3tail.reset``) does it on every rank between two barriers, with no kernel in flight.

Sharing rule: only kernels that every rank launches in the same order may share a
workspace (the stage counter advances per launch on each rank independently, so ranks
that interleave differently would read different stages and wait forever).  Every k3tail
op therefore owns its workspaces.
"""

from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass, field
from typing import Optional

import torch

from k3tail.errors import K3TailError, fault_error
from k3tail.runtime.comm import Comm, DistComm, comm_for, host_deadline
from k3tail.runtime.loopback import LoopbackGroup
from k3tail.runtime.modes import interpret_mode
from k3tail.runtime.sentinel import arm_region
from k3tail.triton_kernels.lamport import (CALL_BITS, CALL_SHIFT, CTRL_BYTES, CTRL_CALL, CTRL_FAULT_GOT,
                                           CTRL_FAULT_TAG, CTRL_POISON)

_ALIGN = 4096
SHM_PREFIX_ENV = "K3TAIL_SHM_PREFIX"


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def _check_not_capturing(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise K3TailError(f"{what}: workspaces allocate and rendezvous at construction only; "
                          "construct k3tail ops before CUDA-graph capture, not inside it")


def resolve_device(comm: Optional[Comm], device=None) -> torch.device:
    """The device of an op's tensors and workspaces on ``comm`` (DESIGN §5; docs/integration.md).

    ``device`` given: that device (``"cuda"`` means the current CUDA device); a loopback group
    must be given its world's device.  ``None``: a loopback group's world device; a process
    group whose backend carries CUDA tensors (NCCL) the current CUDA device; a world of one
    (``comm`` None or any other :class:`Comm`) the current CUDA device when CUDA is available;
    otherwise the CPU.  Never a guess from a CPU group for CUDA tensors: an engine's gloo
    ``cpu_group`` gets the CPU unless ``device=`` says otherwise.

    Raises ``ValueError`` naming ``device`` for anything but a CPU or an existing CUDA device,
    before the caller allocates anything.
    """
    if device is not None:
        try:
            dev = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from e
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={device!r}: CUDA is not available here")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            elif not 0 <= dev.index < torch.cuda.device_count():
                raise ValueError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices here")
        elif dev.type != "cpu":
            raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
        else:  # "cpu:0" names the one CPU device, but compares unequal to the tensors' torch.device("cpu")
            dev = torch.device("cpu")
        if isinstance(comm, LoopbackGroup) and dev != comm.world.device:
            raise ValueError(f"device={dev}: a loopback group's tensors live on its world's device "
                             f"{comm.world.device}")
        return dev
    if isinstance(comm, LoopbackGroup):
        return comm.world.device
    if isinstance(comm, DistComm):
        return comm._device()
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------- workspace
@dataclass
class Workspace:
    """What a kernel needs to reach its peers; see the module docstring."""

    backend: str
    rank: int
    world_size: int
    device: torch.device
    nbytes: int
    table: torch.Tensor
    local: torch.Tensor
    ctrl: torch.Tensor
    host_flag: torch.Tensor
    multicast_ptr: int = 0
    group_name: str = ""
    ctrl_off: int = 0
    arm32: tuple = ()
    _keep: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        self.ftab = self.table + self.ctrl_off  # every rank's control block (its fault word)
        self.fault_blk = self.ctrl
        self.fault_owner: "Workspace" = self
        self._call_word = self.ctrl[CTRL_CALL:CTRL_CALL + 1]
        self._mirror = self.host_flag.numpy()  # the same (pinned) host memory: a read without torch's dispatch

    def bind_fault(self, owner: "Workspace") -> None:
        """Check and post faults in ``owner``'s fault block (a group's shared one) instead of
        this workspace's own; ``owner`` must be a workspace of the same group and device."""
        if owner.world_size != self.world_size or owner.device != self.device:
            raise K3TailError("bind_fault: the fault block must belong to the same group and device")
        self.fault_blk, self.ftab, self.host_flag = owner.ctrl, owner.ftab, owner.host_flag
        self._mirror = owner._mirror
        self.fault_owner = owner
        self._call_word = owner._call_word

    def advance_call(self) -> None:
        """Count one more call of this rank on the device (the fault block's ``CTRL_CALL``), on the
        current stream before the call's first launch; a CUDA graph captures it.  Called once per call
        by the owner of the call's tag, so that fault records name their call (``lamport.py``)."""
        self._call_word.add_(1)

    def poisoned(self) -> bool:
        """Has a fault been seen here?  Reads the host mirror: never syncs (through a numpy view of the
        host flag's memory, 0.1 us against 2 us for ``host_flag[0].item()``: every eager call reads it)."""
        return bool(self._mirror[0])

    def fault_word(self) -> int:
        """The fault word (packed record; 0 = healthy) of the fault block (a device read: syncs)."""
        return int(self.fault_blk[CTRL_POISON].item())

    def fault_word_view(self) -> torch.Tensor:
        """The fault word as a 0-dim int32 view on the device (reading it into a kernel or a torch op
        does not sync the host: what the group header folds into a rank's status slot)."""
        return self.fault_blk[CTRL_POISON]

    def fault_word_of_this_call(self) -> int:
        """The fault word if its record belongs to this rank's current call (its device call count)
        or an earlier one, else 0: a peer's record of a later call is obeyed from that call on, the
        rule of ``lamport.is_poisoned`` on the host (a device read: syncs)."""
        word = self.fault_word()
        if word == 0:
            return 0
        mask = (1 << CALL_BITS) - 1
        ahead = ((word >> CALL_SHIFT) - int(self._call_word.item())) & mask
        return word if ahead == 0 or ahead >= (mask + 1) // 2 else 0

    def fault_so_far(self) -> bool:
        """Has this rank a fault among its calls so far: the host mirror, or a record of its current
        call or an earlier one in the fault word (:meth:`fault_word_of_this_call`; a device read)?"""
        return self.poisoned() or bool(self.fault_word_of_this_call())

    def fault_tags(self) -> tuple:
        """``(own tag, tag seen)`` that the detecting kernel of this rank noted (meaningful when the
        record's detecting rank is this rank)."""
        v = self.fault_blk[CTRL_FAULT_TAG:CTRL_FAULT_GOT + 1].tolist()
        return int(v[0]), int(v[1])

    def error(self, op: str, timeout_s: float, *, before: bool, detail: str = ""):
        """The :class:`k3tail.PeerFault` of this workspace's fault record."""
        word = self.fault_word()
        d = detail or f"group {self.group_name}"
        rec_det = (word >> 12) & 0xFF
        if word and rec_det == self.rank and (word & 0xF) == 2:
            mine, got = self.fault_tags()
            d += f"; call tag {mine}, the peer's {got}"
        return fault_error(op, self.rank, self.world_size, word, waited_s=timeout_s, detail=d, before=before)

    def check(self, op: str, timeout_s: float) -> None:
        """Raise :class:`WorkspacePoisoned` if a fault was seen earlier (before this call)."""
        if self.poisoned():
            raise self.error(op, timeout_s, before=True)

    def sync_check(self, op: str, timeout_s: float) -> None:
        """Wait for this rank's device work, then raise the fault if the fault word holds a record
        of this rank's calls so far (the ops' ``.check()``; reads the fault word itself, not only the
        host mirror; a peer's record of a later call fails that call, :meth:`fault_word_of_this_call`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.fault_so_far():
            raise self.error(op, timeout_s, before=True)

    def rearm(self) -> None:
        """Arm this rank's region again and zero its control block, in place (recovery; the caller
        guarantees that no kernel of any rank uses the workspace meanwhile: ``k3tail.reset``)."""
        arm_region(self.local, self.arm32)
        self.local[self.ctrl_off:self.ctrl_off + CTRL_BYTES].zero_()
        self.fault_owner.host_flag.zero_()
        self.host_flag.zero_()

    def slots(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's own region viewed as ``dtype`` (for tests and debugging)."""
        return self.local.view(dtype)


def _layout(nbytes: int) -> tuple:
    """``(ctrl_off, total)``: the control block after the data, the region rounded to pages."""
    ctrl_off = _round_up(max(int(nbytes), 2), 256)
    return ctrl_off, _round_up(ctrl_off + CTRL_BYTES)


def _ctrl_view(local: torch.Tensor, ctrl_off: int) -> torch.Tensor:
    """The control block inside ``local`` (zeroed): an int32 view of CTRL_WORDS words."""
    blk = local[ctrl_off:ctrl_off + CTRL_BYTES]
    blk.zero_()
    return blk.view(torch.int32)


def _host_flag(device: torch.device) -> torch.Tensor:
    host_flag = torch.zeros(1, dtype=torch.int32)
    if device.type == "cuda":
        host_flag = host_flag.pin_memory()
    return host_flag


def local_workspace(nbytes: int, device: torch.device, arm32=()) -> Workspace:
    """A world of one: a plain local region (no peers, no rendezvous), the same layout and kernels."""
    arm32 = tuple((int(o), int(n)) for o, n in arm32)
    ctrl_off, total = _layout(nbytes)
    region = torch.empty(total, dtype=torch.uint8, device=device)
    arm_region(region, arm32)
    ctrl = _ctrl_view(region, ctrl_off)
    table = torch.tensor([region.data_ptr()], dtype=torch.int64, device=device)
    return Workspace("local", 0, 1, device, region.numel(), table, region, ctrl, _host_flag(device), 0, "local",
                     ctrl_off, arm32, _keep=[region])


def create_workspace(group, nbytes: int, *, device: Optional[torch.device] = None,
                     what: str = "k3tail", arm32=(), timeout_s: Optional[float] = None) -> Workspace:
    """Allocate (collectively) a region of ``nbytes`` per rank and build its peer table.

    Every rank of ``group`` must call this in the same order with the same arguments.
    ``device``: as :func:`resolve_device` says (None: the group's own device; a loopback
    group's regions are always on its world's device).  The region is armed with 16-bit sentinels,
    except the ``(offset, nbytes)`` ranges in
    ``arm32`` (fp32 slots), before the closing barrier.

    Every host rendezvous inside ends by ``timeout_s`` (None: the enclosing
    ``k3tail.runtime.comm.host_deadline``'s, e.g. the constructing module's) plus the slack, on every
    rank alike (``k3tail.runtime.comm``).
    """
    arm32 = tuple((int(o), int(n)) for o, n in arm32)
    _check_not_capturing(what)
    ctrl_off, nbytes = _layout(nbytes)
    comm = comm_for(group)
    device = resolve_device(comm, device)  # ValueError before anything is allocated
    with host_deadline(comm, timeout_s, what=f"workspace {what}"):
        if isinstance(comm, LoopbackGroup):
            return _loopback_workspace(comm, nbytes, ctrl_off, arm32)
        if device.type == "cpu":
            return _shm_workspace(comm, nbytes, ctrl_off, arm32)
        return _symm_mem_workspace(comm, nbytes, ctrl_off, device, arm32)


def _loopback_workspace(comm: LoopbackGroup, nbytes: int, ctrl_off: int, arm32) -> Workspace:
    world = comm.world
    bufs = world._region(comm._seq, nbytes, arm32)
    comm._seq += 1
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=world.device)
    # each virtual rank zeroes its own control block (before its first launch; a peer posts into
    # it only during calls, after construction)
    ctrl = _ctrl_view(bufs[comm.rank], ctrl_off)
    return Workspace("loopback", comm.rank, comm.world_size, world.device, nbytes, table,
                     bufs[comm.rank], ctrl, _host_flag(world.device), 0, comm.name, ctrl_off, arm32, _keep=[bufs])


def _shm_workspace(comm: Comm, nbytes: int, ctrl_off: int, arm32) -> Workspace:
    if not interpret_mode():
        raise K3TailError("CPU workspaces run their kernels in the Triton interpreter: set "
                          "TRITON_INTERPRET=1 before importing k3tail (k3tail.runtime.spawn does)")
    W = comm.world_size
    total = nbytes * W
    prefix = os.environ.get(SHM_PREFIX_ENV, "k3tail-")
    name = None
    if comm.rank == 0:
        name = f"/dev/shm/{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)
        finally:
            os.close(fd)
    mm, err = None, None
    try:
        name = comm.broadcast_object(name, src=0)
        try:
            fd = os.open(name, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        except OSError as e:
            err = e
        mapped = comm.exchange("mapped", err is None)  # everyone mapped it (or failed): the name can go
    finally:
        if comm.rank == 0 and name is not None:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
    if not all(mapped):  # every rank raises: none goes on to a rendezvous that a peer skips
        bad = [r for r, ok in enumerate(mapped) if not ok]
        raise K3TailError(f"shared-memory workspace: rank(s) {bad} could not map {name}"
                          + (f" ({type(err).__name__}: {err})" if err is not None else ""))
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    local = whole[comm.rank * nbytes:(comm.rank + 1) * nbytes]
    arm_region(local, arm32)
    ctrl = _ctrl_view(local, ctrl_off)
    base = whole.data_ptr()
    table = torch.tensor([base + d * nbytes for d in range(W)], dtype=torch.int64)
    comm.barrier()  # every region armed before anyone may write
    return Workspace("shm", comm.rank, W, torch.device("cpu"), nbytes, table, local, ctrl,
                     _host_flag(torch.device("cpu")), 0, getattr(comm, "name", "") or "", ctrl_off, arm32,
                     _keep=[mm, whole])


def _symm_mem_workspace(comm: DistComm, nbytes: int, ctrl_off: int, device: torch.device, arm32) -> Workspace:
    import torch.distributed._symmetric_memory as symm_mem

    group_name = comm.name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        try:
            enable(group_name)
        except Exception:  # already enabled, or not needed on this torch
            pass
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    comm.barrier()  # bounded: every rank enters torch's rendezvous (it waits on the store, unbounded by us)
    hdl = symm_mem.rendezvous(buf, group_name)
    arm_region(buf, arm32)
    ctrl = _ctrl_view(buf, ctrl_off)
    table = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=device)
    mc = int(getattr(hdl, "multicast_ptr", 0) or 0)
    torch.cuda.synchronize(device)
    comm.barrier()
    return Workspace("symm_mem", comm.rank, comm.world_size, device, nbytes, table, buf, ctrl,
                     _host_flag(device), mc, group_name, ctrl_off, arm32, _keep=[buf, hdl])
