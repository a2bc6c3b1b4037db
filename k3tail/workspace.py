"""Symmetric workspaces: one interface, three backends (DESIGN §5).

A :class:`Workspace` gives a kernel everything it needs to reach its peers:

* ``table``     int64 tensor ``[W]`` on the kernel's device, ``table[d]`` = base address of
                rank d's region (the same layout on every rank);
* ``ctrl``      int32 control block ``[CTRL_WORDS]`` local to this rank (stage counter,
                poison flag, launch counter, per-op words), see ``triton_kernels/lamport.py``;
* ``host_flag`` int32 ``[1]`` host-visible mirror of the poison flag (pinned on CUDA), so
                the host can fail fast without synchronizing;
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
that raises).  Regions are armed with the sentinel before the closing barrier, so no
peer can write before its slot is armed.

Sharing rule: only kernels that every rank launches in the same order may share a
workspace (the stage counter advances per launch on each rank independently, so ranks
that interleave differently would read different stages and wait forever).  Every k3tail
op therefore owns its workspaces.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import K3TailError, WorkspacePoisoned

log = logging.getLogger("k3tail")

CTRL_WORDS = 16
_ALIGN = 4096
SHM_PREFIX_ENV = "K3TAIL_SHM_PREFIX"


def interpret_mode() -> bool:
    """True when Triton kernels run in the interpreter (CPU ranks)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _round_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def arm_region(region: torch.Tensor, arm32=()) -> None:
    """Fill a uint8 region with sentinels: 16-bit -0.0 everywhere, except the
    ``(offset, nbytes)`` ranges of ``arm32`` (fp32 slots), which get the 32-bit -0.0."""
    region.view(torch.int16).fill_(-32768)
    for off, n in arm32:
        if off % 4 or n % 4 or off + n > region.numel():
            raise ValueError(f"fp32 slot range ({off}, {n}) misaligned or outside the region")
        region[off:off + n].view(torch.int32).fill_(-(2 ** 31))


def _check_not_capturing(what: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise K3TailError(f"{what}: workspaces allocate and rendezvous at construction only; "
                          "construct k3tail ops before CUDA-graph capture, not inside it")


# --------------------------------------------------------------------------- comms
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


def _rank_streams(device: torch.device, n: int) -> list:
    """``n`` pooled streams that are neither the current stream nor torch.cuda.graph's default
    capture stream (created here if torch has not made it yet, as torch would): the pool hands
    out 32 streams per priority in turn, so after 32 a new stream can be an old one, and a rank
    stream that is the capture stream would serialize the ranks behind a spinning kernel."""
    if getattr(torch.cuda.graph, "default_capture_stream", "absent") is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    cap = getattr(torch.cuda.graph, "default_capture_stream", None)
    avoid = {torch.cuda.current_stream(device).cuda_stream}
    if cap is not None and cap.device == device:
        avoid.add(cap.cuda_stream)
    out = []
    for _ in range(n + 64):
        if len(out) == n:
            break
        s = torch.cuda.Stream(device=device)
        if s.cuda_stream not in avoid:
            avoid.add(s.cuda_stream)
            out.append(s)
    if len(out) < n:
        raise K3TailError(f"LoopbackWorld({n}): torch's stream pool has too few distinct streams for {n} "
                          f"virtual ranks (32 per priority, less the current and the capture stream)")
    return out


class LoopbackWorld:
    """W virtual ranks in one process on one GPU, each with its own stream.

    ``world.group(r)`` is the ``group=`` argument for rank r's ops.  Construct the ops of
    all ranks with :meth:`build` (one thread per rank, so construction-time collectives
    such as the capability vote can meet), and call them with :meth:`run` (one host
    thread issuing each rank's launches on that rank's stream, fork/joined with the
    current stream so the whole thing can be captured into one CUDA graph).  All W
    grids must be co-resident on the GPU: ops cap their grids with ``_launch.grid_cap``.
    """

    def __init__(self, world_size: int, device: Optional[torch.device] = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not torch.cuda.is_available():
            raise K3TailError("LoopbackWorld needs a CUDA GPU (the interpreter runs the programs "
                              "of one process one after another, so virtual ranks would deadlock); "
                              "use k3tail.spawn(device='cpu') for CPU ranks")
        self.world_size = world_size
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.streams = _rank_streams(self.device, world_size)
        self._lock = threading.Lock()
        self._regions: dict = {}
        self._barrier = threading.Barrier(world_size)
        self._slots: List[Any] = [None] * world_size
        self._groups = [LoopbackGroup(self, r) for r in range(world_size)]

    def group(self, rank: int) -> "LoopbackGroup":
        """Rank ``rank``'s group (the same object every time: it counts the rank's workspaces)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return self._groups[rank]

    def build(self, fn: Callable[[int], Any]) -> list:
        """Run ``fn(rank)`` for every rank in its own thread (for collective construction)."""
        results: List[Any] = [None] * self.world_size
        errors: List[Any] = [None] * self.world_size

        def body(r):
            try:
                torch.cuda.set_device(self.device)
                results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        for r, e in enumerate(errors):
            if e is not None and not isinstance(e, threading.BrokenBarrierError):
                raise K3TailError(f"loopback rank {r} failed during construction: {e!r}") from e
        for r, e in enumerate(errors):
            if e is not None:
                raise K3TailError(f"loopback rank {r} failed during construction: {e!r}") from e
        return results

    def run(self, fn: Callable[[int], Any], warm: bool = True) -> list:
        """Issue ``fn(rank)`` for every rank on that rank's stream; return the results.

        Outside CUDA-graph capture, ``fn`` first runs once per rank with kernel launches
        suppressed (``_launch.warm_only``), so every Triton variant is compiled and loaded
        before any rank's kernel can spin (a module load blocks while one does).  ``fn``
        must therefore only launch work (no host reads of its results).  ``warm=False``
        skips that pass (timed loops whose every variant is already loaded: the pass would
        run their torch ops a second time inside the measured interval).
        """
        cur = torch.cuda.current_stream(self.device)
        if any(s.cuda_stream == cur.cuda_stream for s in self.streams):
            raise K3TailError(
                "LoopbackWorld.run: the current stream is one of the virtual ranks' streams (torch hands out "
                "its pooled streams in turn, 32 per priority, so a stream made later, such as the default "
                "capture stream of torch.cuda.graph, can be the same CUDA stream); a rank's spinning kernel "
                "would then hold back the ranks launched after it.  Capture on a stream of your own: "
                "torch.cuda.graph(g, stream=s) with s not in world.streams")
        if warm and not torch.cuda.is_current_stream_capturing():
            from ._launch import warm_only

            with warm_only():
                self._fan_out(cur, fn)
        return self._fan_out(cur, fn)

    def _fan_out(self, cur, fn) -> list:
        """``fn(r)`` on rank r's stream, forked from and joined back into ``cur``.  Both passes
        of :meth:`run` fork: the warm pass runs ``fn``'s torch ops for real, and without the
        fork they read inputs that ``cur`` is still writing (seen on the H200: the finalize's
        gather read a half-written ``expanded_idx`` of a fresh M = 8192 input and asserted)."""
        out = []
        for r, s in enumerate(self.streams):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                out.append(fn(r))
        for s in self.streams:
            cur.wait_stream(s)
        return out

    # -- host collectives among the rank threads of build() ------------------------
    def _exchange(self, rank: int, value: Any) -> List[Any]:
        self._barrier.wait()
        self._slots[rank] = value
        self._barrier.wait()
        vals = list(self._slots)
        self._barrier.wait()
        return vals

    def _region(self, seq: int, nbytes: int, arm32=()) -> List[torch.Tensor]:
        with self._lock:
            if seq not in self._regions:
                bufs = [torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                        for _ in range(self.world_size)]
                for b in bufs:
                    arm_region(b, arm32)
                torch.cuda.synchronize(self.device)
                self._regions[seq] = bufs
            bufs = self._regions[seq]
        if bufs[0].numel() != nbytes:
            raise K3TailError(f"loopback workspace #{seq}: ranks asked for different sizes "
                              f"({bufs[0].numel()} vs {nbytes}); ranks must build the same ops in the same order")
        return bufs


class LoopbackGroup(Comm):
    """Rank ``rank`` of a :class:`LoopbackWorld`; pass it as ``group=``."""

    def __init__(self, world: LoopbackWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self._seq = 0
        self.name = f"loopback{world.world_size}"

    def all_reduce_min(self, values):
        rows = self.world._exchange(self.rank, list(values))
        return [min(col) for col in zip(*rows)]

    def broadcast_object(self, obj, src=0):
        return self.world._exchange(self.rank, obj)[src]

    def barrier(self):
        self.world._exchange(self.rank, None)

    @property
    def stream(self) -> torch.cuda.Stream:
        return self.world.streams[self.rank]


def resolve_device(comm: Comm, device=None) -> torch.device:
    """The device of an op's tensors and workspaces on ``comm`` (DESIGN §5; docs/integration.md).

    ``device`` given: that device (``"cuda"`` means the current CUDA device); a loopback group
    must be given its world's device.  ``None``: a loopback group's world device; a process
    group whose backend carries CUDA tensors (NCCL) the current CUDA device; a world of one the
    current CUDA device when CUDA is available; otherwise the CPU.  Never a guess from a CPU
    group for CUDA tensors: an engine's gloo ``cpu_group`` gets the CPU unless ``device=`` says
    otherwise.
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
        elif dev.type != "cpu":
            raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
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


def comm_for(group) -> Comm:
    """The :class:`Comm` for a ``group=`` argument (None = the default process group)."""
    if isinstance(group, Comm):
        return group
    return DistComm(group)


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
    _keep: list = field(default_factory=list, repr=False)

    def poisoned(self) -> bool:
        """Has a wait on this workspace timed out?  Reads the host mirror: never syncs."""
        return bool(self.host_flag[0].item() != 0)

    def check(self, op: str, timeout_s: float) -> None:
        """Raise :class:`WorkspacePoisoned` if an earlier wait timed out."""
        if self.poisoned():
            raise WorkspacePoisoned(op, self.rank, self.world_size, timeout_s,
                                    f"group {self.group_name}: an earlier wait timed out")

    def sync_check(self, op: str, timeout_s: float) -> None:
        """Wait for this rank's device work, then :meth:`check` (the ops' ``.check()``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check(op, timeout_s)

    def slots(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's own region viewed as ``dtype`` (for tests and debugging)."""
        return self.local.view(dtype)


def _new_ctrl(device: torch.device):
    ctrl = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=device)
    host_flag = torch.zeros(1, dtype=torch.int32)
    if device.type == "cuda":
        host_flag = host_flag.pin_memory()
    return ctrl, host_flag


def create_workspace(group, nbytes: int, *, device: Optional[torch.device] = None,
                     what: str = "k3tail", arm32=()) -> Workspace:
    """Allocate (collectively) a region of ``nbytes`` per rank and build its peer table.

    Every rank of ``group`` must call this in the same order with the same arguments.
    The region is armed with 16-bit sentinels, except the ``(offset, nbytes)`` ranges in
    ``arm32`` (fp32 slots), before the closing barrier.
    """
    arm32 = tuple((int(o), int(n)) for o, n in arm32)
    _check_not_capturing(what)
    nbytes = _round_up(max(int(nbytes), 2))
    comm = comm_for(group)
    if isinstance(comm, LoopbackGroup):
        return _loopback_workspace(comm, nbytes, arm32)
    if device is None:
        device = comm._device()
    device = torch.device(device)
    if device.type == "cpu":
        return _shm_workspace(comm, nbytes, arm32)
    return _symm_mem_workspace(comm, nbytes, device, arm32)


def _loopback_workspace(comm: LoopbackGroup, nbytes: int, arm32) -> Workspace:
    world = comm.world
    bufs = world._region(comm._seq, nbytes, arm32)
    comm._seq += 1
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=world.device)
    ctrl, host_flag = _new_ctrl(world.device)
    return Workspace("loopback", comm.rank, comm.world_size, world.device, nbytes, table,
                     bufs[comm.rank], ctrl, host_flag, 0, comm.name, _keep=[bufs])


def _shm_workspace(comm: Comm, nbytes: int, arm32) -> Workspace:
    if not interpret_mode():
        raise K3TailError("CPU workspaces run their kernels in the Triton interpreter: set "
                          "TRITON_INTERPRET=1 before importing k3tail (k3tail.spawn does)")
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
    name = comm.broadcast_object(name, src=0)
    try:
        fd = os.open(name, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
    finally:
        comm.barrier()  # everyone mapped it (or failed): the name can go
        if comm.rank == 0:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    local = whole[comm.rank * nbytes:(comm.rank + 1) * nbytes]
    arm_region(local, arm32)
    base = whole.data_ptr()
    table = torch.tensor([base + d * nbytes for d in range(W)], dtype=torch.int64)
    ctrl, host_flag = _new_ctrl(torch.device("cpu"))
    comm.barrier()  # every region armed before anyone may write
    return Workspace("shm", comm.rank, W, torch.device("cpu"), nbytes, table, local, ctrl,
                     host_flag, 0, getattr(comm, "name", "") or "", _keep=[mm, whole])


def _symm_mem_workspace(comm: DistComm, nbytes: int, device: torch.device, arm32) -> Workspace:
    import torch.distributed._symmetric_memory as symm_mem

    group_name = comm.name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        try:
            enable(group_name)
        except Exception:  # already enabled, or not needed on this torch
            pass
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    hdl = symm_mem.rendezvous(buf, group_name)
    arm_region(buf, arm32)
    table = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=device)
    mc = int(getattr(hdl, "multicast_ptr", 0) or 0)
    ctrl, host_flag = _new_ctrl(device)
    torch.cuda.synchronize(device)
    comm.barrier()
    return Workspace("symm_mem", comm.rank, comm.world_size, device, nbytes, table, buf, ctrl,
                     host_flag, mc, group_name, _keep=[buf, hdl])
