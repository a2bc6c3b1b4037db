"""PeerExchange: named per-rank areas, a device-side flag barrier and a column all-gather pull
(kernels and the full protocol: triton_kernels/exchange.py).  The exchange machinery of the
large-M tail (DESIGN §3.4 steps 2, 4, 5) in loopback and over symmetric memory."""

from __future__ import annotations

import zlib
from typing import Dict, Sequence

import torch

from k3tail.runtime import launch as L
from k3tail.errors import K3TailError
from k3tail.triton_kernels.exchange import CTRL_EPOCH, barrier_kernel, gather_cols_kernel
from k3tail.runtime.comm import comm_for, host_deadline
from k3tail.runtime.modes import interpret_mode
from k3tail.runtime.workspace import create_workspace, resolve_device
from k3tail.runtime.checks import check_real, check_tensor
from k3tail.ops.fault import CallCounter, count_own_call

_AREA_ALIGN = 256
GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)


def _round_up(n: int, a: int = _AREA_ALIGN) -> int:
    return (n + a - 1) // a * a


def reference_gather_cols(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Torch twin of :meth:`PeerExchange.gather_cols`: rank s's ``[M, n_s]`` block lands in
    columns ``[bounds[s], bounds[s+1])`` (bit copies, no arithmetic)."""
    return torch.cat([b.reshape(b.shape[0], -1) for b in blocks], dim=1)


class PeerExchange:
    """Named data areas per rank, a device-side barrier, and a pull of every rank's block.

    ``areas`` maps names to byte sizes; each rank's workspace holds a flag array of W int64
    ``(call tag, epoch)`` words and the areas, disjoint and 256-byte aligned, in the dict's order (every rank must
    construct it with the same areas, in the same order, at the same point: collective).

    Protocol (proof in ``triton_kernels/exchange.py``).  A call of the caller is a sequence of
    *phases*: every rank writes its own area(s) (:meth:`area`, ordinary kernels on the current
    stream), then :meth:`barrier`, then reads the peers' areas (:meth:`gather_cols`, or the
    caller's own kernels through :meth:`peer_table`).  Number the barriers e = 1, 2, ... across
    calls and call segment e what a rank's stream runs after barrier e and before barrier e+1.
    Rule: a version of area X written by its owner in segment w may be read by peers only in
    segments j with w < j < w', w' the segment of the owner's next write of X; i.e. an area is
    rewritten only after a barrier that every reader enters only after it finished reading it.
    The large-M tail (write routed+shared, B1, pull+sum and write stats, B2, read stats and
    write normed, B3, gather normed and write output, B4, gather outputs) keeps it with no
    trailing barrier: the outputs of call c are rewritten only after call c+1's B3, which every
    peer enters after gathering them.  Every rank must issue the same sequence of barriers.

    ``device``: where the workspace lives (``workspace.resolve_device``: None means the group's
    device; a gloo group with ``device="cuda"`` uses torch symmetric memory).

    Bounded waits: a barrier whose peer never arrives within ``timeout_s`` poisons the
    workspace; the host raises :class:`k3tail.PeerTimeout` (interpreter: from that call; GPU:
    from the next call or :meth:`check`), and every later call raises ``WorkspacePoisoned`` at
    once.  W = 1: the barrier is skipped and the gather is a copy.  Calls are CUDA-graph
    capturable (epochs live on the device; peer tables are built once here) once each ``bounds``
    has been used outside capture.
    """

    op_name = "PeerExchange"

    def __init__(self, group=None, *, areas: Dict[str, int], timeout_s: float = 20.0, device=None):
        if not isinstance(areas, dict) or not areas:
            raise ValueError("areas must be a non-empty dict {name: nbytes}")
        for name, size in areas.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"area names must be non-empty strings, got {name!r}")
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError(f"area {name!r}: size must be a positive int (bytes), got {size!r}")
        check_real("timeout_s", timeout_s, low=0, low_open=True, what="number of seconds")
        self.group, self.comm = group, comm_for(group)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.timeout_s = float(timeout_s)
        W = self.world_size
        off = _round_up(8 * W)  # flag[W] (int64) at offset 0
        self.areas: Dict[str, tuple] = {}
        for name, size in areas.items():
            self.areas[name] = (off, size)
            off += _round_up(size)
        dev = resolve_device(self.comm, device)  # ValueError naming device= before any collective
        with host_deadline(self.comm, self.timeout_s, what=self.op_name):  # bounded, rank-uniform rendezvous
            self._agree(areas)
            self.ws = ws = create_workspace(group, off, device=dev, what=self.op_name)
            self.device = ws.device
            ws.local[:8 * W].zero_()  # flags start at epoch 0 (the region is armed with -0.0 bits)
            if ws.device.type == "cuda":
                torch.cuda.synchronize(ws.device)
            self.comm.barrier()  # every rank's flags zeroed before anyone can arrive
        self._tables = {name: ws.table + o for name, (o, _) in self.areas.items()}
        self._bounds: dict = {}
        self._calls = CallCounter()
        self._no_status = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _agree(self, areas) -> None:
        """Every rank must lay out the same areas: a mismatch would address wrong bytes."""
        names = zlib.crc32("\0".join(areas).encode()) & 0x7FFFFFFF
        sizes = list(areas.values())
        n = self.comm.all_reduce_min([len(sizes), -len(sizes)])
        if n[0] != -n[1]:
            raise ValueError(f"{self.op_name}: ranks were given different numbers of areas")
        v = [names, *sizes]
        got = self.comm.all_reduce_min(v + [-x for x in v])
        if got[:len(v)] != [-x for x in got[len(v):]]:
            raise ValueError(f"{self.op_name}: ranks were given different areas (names, order or sizes)")

    # ------------------------------------------------------------------ accessors
    def _area(self, name: str) -> tuple:
        if name not in self.areas:
            raise ValueError(f"unknown area {name!r} (areas: {list(self.areas)})")
        return self.areas[name]

    def area(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This rank's own area ``name`` as a 1-D ``dtype`` tensor of ``numel`` elements (write
        your send data here with ordinary kernels on the current stream)."""
        off, size = self._area(name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > size:
            raise ValueError(f"area {name!r} holds {size} bytes; {numel} x {dtype} needs {nbytes}")
        return self.ws.local[off:off + nbytes].view(dtype)

    def peer_table(self, name: str) -> torch.Tensor:
        """int64 ``[W]`` on the device: every rank's address of area ``name`` (built once)."""
        self._area(name)
        return self._tables[name]

    def check(self) -> None:
        """Synchronize this rank's device and raise if a wait timed out (or any fault was posted)."""
        self.ws.sync_check(self.op_name, self.timeout_s)

    def rearm(self) -> None:
        """Recovery, collective (``k3tail.reset``): arm the region, zero the control block and the flags."""
        self.ws.rearm()
        self.ws.local[:8 * self.world_size].zero_()

    # ------------------------------------------------------------------ operations
    def barrier(self, *, tag=None, status=None) -> None:
        """Arrive at every rank, wait (bounded) until every rank arrived; see the class docstring.
        ``tag``: the caller's call tag (default: this op's own barrier count), which every peer's
        barrier of the same epoch must carry (else :class:`k3tail.PeerMismatch` on every rank);
        ``status``: an int32 ``[1]`` device word; non-zero makes this rank post an INDEX fault
        instead of arriving."""
        own = self._calls.next(0)
        ws = self.ws
        ws.check(self.op_name, self.timeout_s)
        if self.world_size == 1:
            return  # no peer: stream order already orders our own writes and reads
        count_own_call(ws, tag)
        pdl = L.pdl_enabled(ws.device)
        # One spinning program per rank: co-resident under every grid cap (L.grid_cap >= 1).
        L.launch(barrier_kernel, (1,), ws.table, ws.ctrl, ws.fault_blk, ws.ftab, ws.host_flag, L.clock_arg(ws),
                 self._no_status if status is None else status, ws.rank, int(self.timeout_s * 1e9),
                 own if tag is None else int(tag),
                 W=self.world_size, W_P2=L.next_pow2(self.world_size), CTRL_EPOCH_=CTRL_EPOCH,
                 USE_GLOBALTIMER=not interpret_mode(), USE_PDL=pdl, pdl=pdl, num_warps=1)
        L.after_launch(ws, self.op_name, self.timeout_s)

    def _bounds_tensor(self, bounds: tuple) -> torch.Tensor:
        t = self._bounds.get(bounds)
        if t is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise K3TailError(f"{self.op_name}.gather_cols: bounds {list(bounds)} first seen inside "
                                  "CUDA-graph capture; call it once with these bounds before capturing")
            t = torch.tensor(bounds, dtype=torch.int32, device=self.device)
            self._bounds[bounds] = t
        return t

    def gather_cols(self, name: str, *, M: int, bounds: Sequence[int], dtype: torch.dtype,
                    out: torch.Tensor) -> torch.Tensor:
        """``out[:, bounds[s]:bounds[s+1]] = rank s's area `name` as [M, n_s] row-major`` for every
        rank s, one launch.  ``out`` is ``[M, bounds[-1]]`` of ``dtype`` with unit column stride
        (its row stride may be larger: a column slice of a wider tensor).  Returns ``out``."""
        off, size = self._area(name)
        W = self.world_size
        if dtype not in GATHER_DTYPES:
            raise ValueError(f"dtype must be one of {list(GATHER_DTYPES)}, got {dtype}")
        if not isinstance(M, int) or isinstance(M, bool) or M < 0:
            raise ValueError(f"M must be a non-negative int, got {M!r}")
        try:
            b = tuple(int(x) for x in bounds)
        except (TypeError, ValueError):
            raise ValueError(f"bounds must be a sequence of W + 1 = {W + 1} ints, got {bounds!r}") from None
        if len(b) != W + 1 or b[0] != 0 or any(b[s + 1] < b[s] for s in range(W)):
            raise ValueError(f"bounds must be W + 1 = {W + 1} non-decreasing ints from 0, got {list(b)}")
        elem = torch.empty((), dtype=dtype).element_size()
        widest = max(b[s + 1] - b[s] for s in range(W))
        if M * widest * elem > size:
            raise ValueError(f"area {name!r} holds {size} bytes; a [{M}, {widest}] {dtype} block needs "
                             f"{M * widest * elem}")
        N = b[-1]
        check_tensor("out", out, dtype=dtype, device=self.device, ndim=2, shape=(M, N), contiguous=False)
        if N > 1 and out.stride(1) != 1 or M > 1 and out.stride(0) < N:
            raise ValueError(f"out must have unit column stride and row stride >= {N}, got strides {out.stride()}")
        ws = self.ws
        ws.check(self.op_name, self.timeout_s)
        if M == 0 or N == 0:
            return out
        block_n = min(L.next_pow2(widest), 256)
        # Tiles depend on the widest block only, not on M: one variant per (area use, dtype).
        block_m = min((16384 if interpret_mode() else 4096) // block_n, 1024)
        align = 16 // elem  # widest vector: 16 bytes
        for v in [b[s + 1] - b[s] for s in range(W)] + [out.stride(0) if M > 1 else N]:
            while v % align:
                align //= 2
        tiles = sum(-(-M // block_m) * -(-(b[s + 1] - b[s]) // block_n) for s in range(W))
        cap = 4 if interpret_mode() else 4 * torch.cuda.get_device_properties(ws.device).multi_processor_count
        pdl = L.pdl_enabled(ws.device)
        L.launch(gather_cols_kernel, (max(1, min(tiles, cap)),),
                 out, self._tables[name], self._bounds_tensor(b), ws.fault_blk, M, out.stride(0),
                 W=W, BLOCK_M=block_m, BLOCK_N=block_n, ALIGN=align, USE_PDL=pdl, pdl=pdl)
        return out
