"""The collectives the tiers need, one interface for every kind of world (DESIGN §3.4, §5).

A tier is written once against :class:`Collectives`; the kind of world hides behind it:

* ``solo``  -- a world of one: every collective is the identity (no copies where none are needed);
* ``group`` -- a ``torch.distributed`` process group (NCCL on CUDA, gloo on CPU):
  ``all_reduce``, ``all_to_all_single`` (uneven splits), ``all_gather_into_tensor``;
* ``peer``  -- peers reached through a workspace's pointer table (loopback, CPU shared memory,
  torch symmetric memory): the foundation's one-shot Lamport kernels and
  :class:`k3tail.ops.exchange.PeerExchange`'s barrier and pulls.

Two families of operations:

1. Self-synchronizing, callable at any time: :meth:`Collectives.all_reduce_sum` (fp32 result;
   ``fp64=True`` sums in fp64 so the result does not depend on the summation order) and
   :meth:`Collectives.all_gather_cols` (column shards -> full rows, an exact copy).  The peer
   kind runs them on Lamport workspaces (slots re-armed by their readers, 3-stage rotation:
   ``triton_kernels/allreduce.py``), so consecutive calls need no barrier.

2. The *phased* shard exchange of the large-M path (:class:`ShardExchange`, ``coll.exchange``):
   every rank writes its send data into :meth:`ShardExchange.area`, calls
   :meth:`ShardExchange.publish`, then reads the peers' data with
   :meth:`ShardExchange.reduce_shards` (its own column shard of every rank's send layout,
   summed in rank order in fp64 and rounded once to fp32: ``k3tail.ops.prefill.ordered_sum``) or
   :meth:`ShardExchange.gather` (every rank's block into its columns).  Peer kind: ``publish``
   is ``PeerExchange.barrier`` and the areas are symmetric, so the caller must keep
   PeerExchange's area rule (an area is rewritten only after a barrier that every reader enters
   after it finished reading it; the large-M call sequence in ``k3tail.tier_paths`` does, with
   four barriers per call and none trailing).  Group kind: ``publish`` does nothing; each read is
   one blocking NCCL/gloo collective on the current stream.  Solo: the areas are fresh tensors
   and the reads return them.

The send layout (``k3tail.ops.prefill``): dest d's block of an ``[M, n]`` matrix is the row-major
``[M, b[d+1] - b[d]]`` block at element ``M * b[d]``, ``b = shard_bounds(n, W)``.  The exchanges
and gathers copy: 16-bit data travels in its own dtype and is never summed by a collective.

One call, one pairing (DESIGN §9).  The peer kind's waiting operations take the caller's call
``tag`` (checked by every peer, ``triton_kernels/lamport.py``) and, for the first exchange of a
routed partial, the ``status`` word of the finalize that produced it (an index out of range there
becomes an INDEX fault on every rank).  The group kind cannot check tags inside NCCL/gloo
collectives, so ``k3tail.module`` starts every call that uses them with :meth:`GroupCollectives.header`,
a tiny MIN all-reduce that every rank joins (also a rank that rejected its inputs, with ``ok = 0``),
bounded by ``timeout_s`` (``work.wait(timeout)``).
"""

from __future__ import annotations

import datetime
import threading
import weakref
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from k3tail.errors import K3TailError, PeerTimeout
from k3tail.ops.allreduce import Fp32AllReduce, OneShotAllReduce
from k3tail.ops.exchange import PeerExchange
from k3tail.ops.prefill import ordered_sum, pack_shards, shard_bounds
from k3tail.runtime.comm import DistComm
from k3tail.runtime.loopback import LoopbackGroup, group_identity

PEER_CHUNK = 64  # rows per launch of the peer kind's one-shot all-reduce / gather


def _gather_fn():
    # all_gather_single replaces all_gather_into_tensor (deprecated in torch 2.13); same signature
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def place_cols(blocks: torch.Tensor, bounds: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """``out[:, b[s]:b[s+1]] = blocks[s][:M * n_s] as [M, n_s]`` (``blocks [W, >= M * n_s]``)."""
    M = out.shape[0]
    for s in range(len(bounds) - 1):
        n = bounds[s + 1] - bounds[s]
        out[:, bounds[s]:bounds[s + 1]] = blocks[s, :M * n].view(M, n)
    return out


# ============================================================================ interface
class ShardExchange:
    """The phased exchange of the large-M path (module docstring, family 2)."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._areas: Dict[str, torch.Tensor] = {}

    def area(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This rank's 1-D send area ``name`` (valid until the call's next write of it)."""
        t = torch.empty(numel, dtype=dtype, device=self.device)
        self._areas[name] = t
        return t

    def put(self, name: str, x: torch.Tensor, bounds: Optional[Sequence[int]] = None) -> None:
        """Write ``x [M, n]`` (exact copy, its own dtype) into area ``name``: in the send layout
        of ``bounds`` (for :meth:`reduce_shards`), or as this rank's own block with ``bounds=None``
        (for :meth:`gather`).  Solo: no copy at all."""
        out = self.area(name, x.dtype, x.numel())
        if bounds is None:
            out.copy_(x.reshape(-1))
        else:
            pack_shards(x, bounds, out=out)

    def publish(self, *, tag: Optional[int] = None, status: Optional[torch.Tensor] = None) -> None:
        """Every rank's writes so far become readable by its peers (peer kind: a barrier that checks
        the call ``tag`` and carries the finalize's ``status``)."""

    def reduce_shards(self, name: str, *, M: int, bounds: Sequence[int], dtype: torch.dtype, sumsq: bool):
        """``(x [M, n_own], ss64 [M] or None)``: this rank's shard of every rank's send layout
        ``name``, summed in rank order (fp64, one rounding to fp32).  Solo without ``sumsq``
        returns the area itself (its own dtype: the sum of one term is exact)."""
        raise NotImplementedError

    def gather(self, name: str, *, M: int, bounds: Sequence[int], dtype: torch.dtype,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[M, bounds[-1]]``: rank s's area ``name`` (``[M, n_s]`` row-major) in its columns."""
        raise NotImplementedError

    def end_call(self) -> None:
        """The call is over: drop this call's per-call areas (solo and group kinds allocate them
        from the caching allocator; keeping them would pin ~``M * (4 L + 2 e H)`` bytes per layer)."""
        self._areas.clear()


class Collectives:
    """What the tiers need from a world; see the module docstring.  ``exchange`` is the
    :class:`ShardExchange` (None where the large-M path was not allocated)."""

    kind = "abstract"

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.exchange: Optional[ShardExchange] = None

    def all_reduce_sum(self, x: torch.Tensor, *, fp64: bool, tag: Optional[int] = None,
                       status: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce_sums(self, xs: Sequence[torch.Tensor], *, fp64: bool, tag: Optional[int] = None,
                        status: Optional[torch.Tensor] = None) -> list:
        """:meth:`all_reduce_sum` of each ``[M, n_i]`` tensor (a kind may fuse them into one); ``status``
        goes with the first."""
        return [self.all_reduce_sum(x, fp64=fp64, tag=tag, status=status if i == 0 else None)
                for i, x in enumerate(xs)]

    def all_gather_cols(self, y: torch.Tensor, bounds: Sequence[int], *, tag: Optional[int] = None) -> torch.Tensor:
        raise NotImplementedError

    def workspaces_ops(self) -> list:
        """The ops holding Lamport workspaces (the module binds them to its group's fault block and
        re-arms them on recovery)."""
        return []


# ============================================================================ solo
class _SoloExchange(ShardExchange):
    def put(self, name, x, bounds=None):
        self._areas[name] = x.reshape(-1)

    def reduce_shards(self, name, *, M, bounds, dtype, sumsq):
        n = bounds[1] - bounds[0]
        src = self._areas[name][:M * n]
        if not sumsq:
            return src.view(M, n), None
        return ordered_sum(M=M, n=n, dtype_in=dtype, src=src.view(1, M, n), sumsq=True)

    def gather(self, name, *, M, bounds, dtype, out=None):
        y = self._areas[name][:M * bounds[-1]].view(M, bounds[-1])
        if out is None:
            return y
        out.copy_(y)
        return out


class SoloCollectives(Collectives):
    kind = "solo"

    def __init__(self, device: torch.device):
        super().__init__(0, 1, device)
        self.exchange = _SoloExchange(0, 1, device)

    def all_reduce_sum(self, x, *, fp64, tag=None, status=None):
        return x if x.dtype == torch.float32 else x.float()

    def all_gather_cols(self, y, bounds, *, tag=None):
        return y


# ============================================================================ process group
class _GroupExchange(ShardExchange):
    def __init__(self, comm: DistComm, device):
        super().__init__(comm.rank, comm.world_size, device)
        self.group = comm.group

    def reduce_shards(self, name, *, M, bounds, dtype, sumsq):
        W, r = self.world_size, self.rank
        n = bounds[r + 1] - bounds[r]
        send = self._areas[name][:M * bounds[-1]]
        recv = torch.empty(W * M * n, dtype=dtype, device=self.device)
        dist.all_to_all_single(recv, send, output_split_sizes=[M * n] * W,
                               input_split_sizes=[M * (bounds[d + 1] - bounds[d]) for d in range(W)],
                               group=self.group)
        return ordered_sum(M=M, n=n, dtype_in=dtype, src=recv.view(W, M, n), sumsq=sumsq)

    def gather(self, name, *, M, bounds, dtype, out=None):
        r = self.rank
        return _group_gather(self._areas[name][:M * (bounds[r + 1] - bounds[r])], M, bounds, self.rank,
                             self.group, self.device, dtype, out)


def _group_gather(own: torch.Tensor, M: int, bounds, rank: int, group, device, dtype, out):
    """All-gather of uneven column blocks: padded to the widest block (one collective)."""
    W = len(bounds) - 1
    widest = max(bounds[s + 1] - bounds[s] for s in range(W))
    if out is None:
        out = torch.empty(M, bounds[-1], dtype=dtype, device=device)
    n = bounds[rank + 1] - bounds[rank]
    send = own.reshape(-1)
    if n != widest:
        padded = torch.zeros(M * widest, dtype=dtype, device=device)
        padded[:M * n] = send
        send = padded
    buf = torch.empty(W * M * widest, dtype=dtype, device=device)  # flat: gloo wants chunks shaped as the input
    _gather_fn()(buf, send.contiguous(), group=group)
    return place_cols(buf.view(W, M * widest), bounds, out)


class GroupCollectives(Collectives):
    kind = "group"

    def __init__(self, comm: DistComm, device: torch.device):
        super().__init__(comm.rank, comm.world_size, device)
        self.comm, self.group = comm, comm.group
        self.exchange = _GroupExchange(comm, device)

    def header(self, vec: torch.Tensor, timeout_s: float, on_late=None, grace_s: float = 2.0):
        """The call header: ``vec`` (int64) MIN-all-reduced in place.  Returns ``(vec on the CPU, late)``.

        A rank that has not joined after ``timeout_s`` is late: ``on_late()`` runs first (the module
        posts a fault into every rank's fault word, which a late rank reads before it joins and then
        joins with ``ok = 0``), then the header gets ``grace_s`` more.  Completed then: ``late`` is
        True and the result says whether the late rank had seen the fault (consistent on every rank:
        the MIN is).  Still not complete: :class:`k3tail.PeerTimeout`, with the pending work as
        ``.work`` (the module keeps it; the late rank's header completes it later)."""
        work = dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            return vec.cpu(), False
        except RuntimeError:
            pass
        if on_late is not None:
            on_late()
        try:
            work.wait(timeout=datetime.timedelta(seconds=grace_s))
            return vec.cpu(), True
        except RuntimeError as e:
            err = PeerTimeout("group header", self.rank, self.world_size, timeout_s + grace_s,
                              f"some rank did not join the call header: {e}")
            err.work = work
            raise err from None

    def post(self, vec: torch.Tensor):
        """Join a header without waiting (a rank that failed: its peers' header completes); the work."""
        return dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

    def all_reduce_sum(self, x, *, fp64, tag=None, status=None):
        if fp64:  # order-free: NCCL/gloo sum in their own order (k3tail.numerics)
            x64 = x.double()
            dist.all_reduce(x64, group=self.group)
            return x64.float()
        x = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_sums(self, xs, *, fp64, tag=None, status=None):
        """One collective for the whole lane ``[x_0 | x_1 | ...]``."""
        lane = torch.cat([x.double() if fp64 else x.float() for x in xs], dim=1)
        dist.all_reduce(lane, group=self.group)
        out, c0 = [], 0
        for x in xs:
            out.append(lane[:, c0:c0 + x.shape[1]].float())
            c0 += x.shape[1]
        return out

    def all_gather_cols(self, y, bounds, *, tag=None):
        return _group_gather(y.contiguous(), y.shape[0], list(bounds), self.rank, self.group, self.device,
                             y.dtype, None)


# ============================================================================ peers (pointer table)
class _PeerExchange(ShardExchange):
    def __init__(self, comm, device, *, areas: Dict[str, int], widths: Sequence[Sequence[int]], timeout_s):

        super().__init__(comm.rank, comm.world_size, device)
        self.px = PeerExchange(comm, areas=areas, timeout_s=timeout_s, device=device)
        for b in widths:  # bounds tensors exist before any CUDA-graph capture
            self.px._bounds_tensor(tuple(int(x) for x in b))

    def area(self, name, dtype, numel):
        return self.px.area(name, dtype, numel)

    def publish(self, *, tag=None, status=None):
        self.px.barrier(tag=tag, status=status)

    def end_call(self):
        pass  # the areas are the symmetric workspace itself

    def reduce_shards(self, name, *, M, bounds, dtype, sumsq):
        r = self.rank
        return ordered_sum(M=M, n=bounds[r + 1] - bounds[r], dtype_in=dtype, src_table=self.px.peer_table(name),
                           src_offset_elems=M * bounds[r], sumsq=sumsq)

    def gather(self, name, *, M, bounds, dtype, out=None):
        if out is None:
            out = torch.empty(M, bounds[-1], dtype=dtype, device=self.device)
        return self.px.gather_cols(name, M=M, bounds=bounds, dtype=dtype, out=out)


class PeerCollectives(Collectives):
    """Peers through pointer tables: loopback, CPU shared memory, torch symmetric memory.
    Allocates (collectively, in this order) the fp32 all-reduces of widths ``latent`` and
    ``hidden``, the 16-bit column gather, and, with ``large_m``, the shard exchange's areas
    sized to ``max_tokens`` rows."""

    kind = "peer"

    def __init__(self, comm, device, *, latent: int, hidden: int, dtype: torch.dtype, max_tokens: int,
                 large_m: bool, timeout_s: float):
        super().__init__(comm.rank, comm.world_size, device)

        W, chunk = comm.world_size, min(PEER_CHUNK, max_tokens)
        self.comm, self.chunk = comm, chunk
        # fp32 slots: the partials travel unrounded (rows in launches of ``chunk``)
        self._ar = {w: Fp32AllReduce(comm, max_tokens=chunk, width=w, timeout_s=timeout_s, device=device)
                    for w in dict.fromkeys((latent, hidden))}
        self._gather = OneShotAllReduce(comm, max_tokens=chunk, width=hidden, dtype=dtype, timeout_s=timeout_s,
                                        device=device)
        self.hidden = hidden
        if large_m:
            bl, bh = shard_bounds(latent, W), shard_bounds(hidden, W)
            e = torch.empty((), dtype=dtype).element_size()
            wide = lambda b: max(b[s + 1] - b[s] for s in range(W))  # noqa: E731
            areas = {"routed": max_tokens * latent * 4, "shared": max_tokens * hidden * e,
                     "stats": max_tokens * 8, "normed": max_tokens * wide(bl) * e,
                     "out": max_tokens * wide(bh) * e}
            self.exchange = _PeerExchange(comm, device, areas=areas, widths=(bl, bh, list(range(W + 1))),
                                          timeout_s=timeout_s)

    def workspaces_ops(self) -> list:
        ops = [*self._ar.values(), self._gather]
        if self.exchange is not None:
            ops.append(self.exchange.px)
        return ops

    def all_reduce_sum(self, x, *, fp64, tag=None, status=None):
        ar = self._ar.get(x.shape[1])
        if ar is None:
            raise K3TailError(f"peer all-reduce: no workspace of width {x.shape[1]}")
        return ar(x.float().contiguous() if x.dtype != torch.float32 else x.contiguous(), tag=tag, status=status)

    def all_gather_cols(self, y, bounds, *, tag=None):
        """The one-shot sum of rows that are zero outside the owner's columns: exact, because
        x + 0 = x in fp32 and the sum is rounded back to the 16-bit x (-0.0 becomes +0.0, as
        in every Lamport tier)."""
        M, N = y.shape[0], bounds[-1]
        if N != self.hidden:
            raise K3TailError(f"peer column gather: width {N} is not the allocated {self.hidden}")
        padded = torch.zeros(M, N, dtype=y.dtype, device=y.device)
        padded[:, bounds[self.rank]:bounds[self.rank + 1]] = y
        out = torch.empty_like(padded)
        for r0 in range(0, M, self.chunk):
            out[r0:r0 + self.chunk] = self._gather(padded[r0:r0 + self.chunk], tag=tag)
        return out


# ============================================================================ choosing a kind
EXCHANGES = ("auto", "peer", "group")


def collectives_kind(comm, device: torch.device, *, exchange: str, p2p: bool) -> str:
    """Which kind of :class:`Collectives` a module on ``comm`` uses (pure, rank-uniform: ``p2p``
    is the vote's agreed P2P answer).  Raises ValueError, naming the group's backend, where the
    group cannot run what is needed on ``device``."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {list(EXCHANGES)}, got {exchange!r}")
    if comm.world_size == 1:
        return "solo"
    if isinstance(comm, LoopbackGroup):
        if exchange == "group":
            raise ValueError("exchange='group': a loopback group has no process group (use 'peer' or 'auto')")
        return "peer"
    if not isinstance(comm, DistComm):
        raise ValueError(f"no collectives for a group of type {type(comm).__name__}")
    backend = str(comm.backend)
    if device.type == "cpu" and not any(b in backend for b in ("gloo", "mpi")):
        raise ValueError(f"the {backend!r} group cannot run collectives on CPU tensors; pass a gloo group "
                         f"for device='cpu', or device='cuda'")
    # CPU tensors: gloo runs every collective; CUDA tensors: NCCL (gloo's CUDA support is partial)
    carries = device.type == "cpu" or "nccl" in backend
    if exchange == "group" or (exchange == "auto" and carries):
        if not carries:
            raise ValueError(f"exchange='group': the {backend!r} group cannot run all_to_all / all_gather on "
                             f"{device} tensors; pass an NCCL group, or exchange='peer' (symmetric memory)")
        return "group"
    if not p2p:
        raise ValueError(f"the {backend!r} group cannot run the tail's collectives on {device} tensors and "
                         f"the vote found no working P2P for the peer kind; pass an NCCL (device) group")
    return "peer"


_peer_pool: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_peer_lock = threading.Lock()


def make_collectives(kind: str, comm, device, **kw) -> Collectives:
    """The module's collectives.  The peer kind's workspaces (about ``max_tokens * (4 L + e H)``
    bytes per rank with the large-M areas: 245 MiB at K3, M = 8192, W = 8) are shared by every module of
    the same world, device and shape while any of them lives: the large-M call sequence leaves
    every area free for the next call whichever module makes it (the argument is the one for
    consecutive calls of one module, ``k3tail.tier_paths``), and the Lamport collectives only
    need every rank to launch in the same order, which the layers do.  Collective: every rank
    must construct its modules in the same order (a rank that hits the pool where another
    allocates would strand it)."""
    if kind == "solo":
        return SoloCollectives(device)
    if kind == "group":
        return GroupCollectives(comm, device)
    key = (group_identity(comm), comm.world_size, str(device), tuple(sorted((k, str(v)) for k, v in kw.items())))
    with _peer_lock:
        coll = _peer_pool.get(key)
    if coll is None:
        coll = PeerCollectives(comm, device, **kw)
        with _peer_lock:
            _peer_pool[key] = coll
    return coll
