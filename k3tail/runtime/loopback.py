"""W virtual ranks in one process on one GPU (:class:`LoopbackWorld`), each on its own stream,
all sharing one peer table; :class:`LoopbackGroup` is one rank's ``group=`` argument (a
:class:`~k3tail.runtime.comm.Comm`).  Re-exported by ``k3tail.runtime.workspace``; the workspace backend that
serves it is ``workspace._loopback_workspace`` (DESIGN §5)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional

import torch

from k3tail.runtime.modes import warm_only
from k3tail.runtime.sentinel import arm_region
from k3tail.runtime.comm import Comm, LocalStore, Rendezvous
from k3tail.errors import K3TailError

__all__ = ["LoopbackGroup", "LoopbackWorld", "group_identity", "rank_streams"]


def _pool_streams(device: torch.device, n: int, avoid: set) -> list:
    """Up to ``n`` streams from torch's pool whose handles are not in ``avoid`` (added to it as taken):
    the pool hands out 32 streams per priority in turn, so a new stream can be an old one."""
    out = []
    for _ in range(n + 64):
        if len(out) == n:
            break
        s = torch.cuda.Stream(device=device)
        if s.cuda_stream not in avoid:
            avoid.add(s.cuda_stream)
            out.append(s)
    return out


def rank_streams(device: torch.device, n: int) -> list:
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
    out = _pool_streams(device, n, avoid)
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
        dev = torch.device(device) if device is not None else torch.device("cuda")
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device for a LoopbackWorld, got {dev}")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.streams = rank_streams(self.device, world_size)
        self._lock = threading.Lock()
        self._regions: dict = {}
        self.store = LocalStore()  # the rank threads' host rendezvous (k3tail.runtime.comm.Rendezvous)
        self._groups = [LoopbackGroup(self, r) for r in range(world_size)]
        # host seconds each rank's ``fn`` took to issue in the last run(): a rank that blocks the one
        # issuing thread while a peer's kernel spins (a host read, a module load) shows here
        self.last_issue_s: List[float] = []
        self._capture = None

    def capture_stream(self) -> "torch.cuda.Stream":
        """A stream to capture this world's calls on (``torch.cuda.graph(g, stream=world.capture_stream())``):
        the same one every time, never one of the ranks' streams nor the current stream.  A fresh
        ``torch.cuda.Stream()`` per capture can be a rank's stream (torch's pool hands out 32 streams per
        priority in turn), and :meth:`run` refuses to issue from it (seen on the H100: the batch-invariance
        test's 33rd capture)."""
        if self._capture is None:
            avoid = {s.cuda_stream for s in self.streams} | {torch.cuda.current_stream(self.device).cuda_stream}
            got = _pool_streams(self.device, 1, avoid)
            if not got:
                raise K3TailError("LoopbackWorld.capture_stream: torch's stream pool has no stream left that "
                                  "is not a virtual rank's")
            self._capture = got[0]
        return self._capture

    def group(self, rank: int) -> "LoopbackGroup":
        """Rank ``rank``'s group (the same object every time: it counts the rank's workspaces)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return self._groups[rank]

    def build(self, fn: Callable[[int], Any]) -> list:
        """Run ``fn(rank)`` for every rank in its own thread (for collective construction).  The rank
        threads' host rendezvous end by their deadlines (``k3tail.runtime.comm``): a rank thread that
        fails inside a construction ends its peers' next rendezvous at once; the error raised here is
        the first rank's own (not a peer's rendezvous fault that followed from it)."""
        results: List[Any] = [None] * self.world_size
        errors: List[Any] = [None] * self.world_size

        def body(r):
            try:
                torch.cuda.set_device(self.device)
                results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r, e in sorted(enumerate(errors), key=lambda re: getattr(re[1], "phase", None) is not None):
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

        If ``fn`` raises for a rank, the ranks after it are still issued (as separate processes
        would each make their call: a rank that fails a call must not keep its peers from theirs),
        the streams are joined, and then the first rank's error is raised; ``last_errors`` holds
        each rank's error (None where ``fn`` returned) until the next run: their tracebacks keep
        that call's frames, inputs included (set it to None to let them go sooner).
        """
        cur = torch.cuda.current_stream(self.device)
        if any(s.cuda_stream == cur.cuda_stream for s in self.streams):
            raise K3TailError(
                "LoopbackWorld.run: the current stream is one of the virtual ranks' streams (torch hands out "
                "its pooled streams in turn, 32 per priority, so a stream made later, such as the default "
                "capture stream of torch.cuda.graph, can be the same CUDA stream); a rank's spinning kernel "
                "would then hold back the ranks launched after it.  Capture on a stream of your own: "
                "torch.cuda.graph(g, stream=world.capture_stream())")
        if warm and not torch.cuda.is_current_stream_capturing():
            with warm_only():
                self._fan_out(cur, fn)
        return self._fan_out(cur, fn)

    def _fan_out(self, cur, fn) -> list:
        """``fn(r)`` on rank r's stream, forked from and joined back into ``cur``.  Both passes
        of :meth:`run` fork: the warm pass runs ``fn``'s torch ops for real, and without the
        fork they read inputs that ``cur`` is still writing (seen on the H200: the finalize's
        gather read a half-written ``expanded_idx`` of a fresh M = 8192 input and asserted)."""
        out, self.last_issue_s, self.last_errors = [], [], []
        for r, s in enumerate(self.streams):
            s.wait_stream(cur)
            t0 = time.monotonic()
            try:
                with torch.cuda.stream(s):
                    out.append(fn(r))
                self.last_errors.append(None)
            except Exception as e:  # noqa: BLE001 - re-raised below, once every rank has issued
                out.append(None)
                self.last_errors.append(e)
            self.last_issue_s.append(time.monotonic() - t0)
        for s in self.streams:
            cur.wait_stream(s)
        first = next((e for e in self.last_errors if e is not None), None)
        if first is not None:
            # The raised error's traceback holds this frame: drop the other ranks' outputs, and
            # drop ``first`` on the way out, or error -> traceback -> frame -> ``first`` is a
            # reference cycle that keeps the faulted call's inputs and working tensors alive until
            # a full garbage collection (the GPU soak's memory grew by 233 MiB over 20 faults).
            out = None
            try:
                raise first
            finally:
                first = None
        return out

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
        self._rdv_: Optional[Rendezvous] = None

    @property
    def _rdv(self) -> Rendezvous:
        """This rank thread's side of the world's host rendezvous (made on first use)."""
        if self._rdv_ is None:
            self._rdv_ = Rendezvous(self.world.store, f"loopback-{id(self.world)}", self.rank, self.world_size)
        return self._rdv_

    def exchange(self, what, state=None):
        """The rank threads' states (``Comm.exchange``), through the world's :class:`LocalStore`: bounded
        by the current host deadline, the same outcome on every rank thread."""
        return self._rdv.exchange(what, state)

    def abandon(self, error):
        self._rdv.abandon(error)

    @property
    def stream(self) -> torch.cuda.Stream:
        return self.world.streams[self.rank]


def group_identity(comm) -> tuple:
    """A hashable name of ``comm``'s world and rank, for process-wide pools of collective
    allocations (``k3tail.ops.tail``'s mailbox pool, ``k3tail.collectives``' peer collectives): every
    rank must reach the same pool entries in the same order (collective construction)."""
    if isinstance(comm, LoopbackGroup):
        return ("loopback", id(comm.world), comm.rank)
    if comm is None:
        return ("local",)
    return ("dist", getattr(comm, "name", None), comm.rank)

