"""Host-side collectives of construction, reset and recovery (vote, rendezvous, barrier): the
:class:`Comm` interface and its ``torch.distributed`` implementation (:class:`DistComm`).  The
other kinds of world implement it too: ``k3tail.runtime.loopback.LoopbackGroup`` (W virtual ranks
in one process) and :class:`SoloComm` (a world of one).  Re-exported by
``k3tail.runtime.workspace``.

Deadlines (issue 32).  Every host wait here ends by a deadline, and ends the same way on every
rank.  :meth:`Comm.exchange` is the one primitive: every rank contributes a small picklable state
and gets every rank's state back, in rank order, or every rank raises.  The vote's MIN, the
broadcasts and the barriers are built on it (:meth:`Comm.all_reduce_min`,
:meth:`Comm.broadcast_object`, :meth:`Comm.barrier`), so construction, ``k3tail.reset`` and the
recovery never enter a gloo/NCCL collective that a peer might never join.

* :class:`DistComm` exchanges through the process group's key-value store (torch.distributed's
  default store), never through the group's collectives: the rendezvous number ``k`` of the group
  (the same on every rank: every rank makes the same exchanges in the same order) names the keys
  ``k3tail/x/<group>/<k>/<rank>`` (each rank's state) and ``.../<k>/d`` (the decision).  A rank sets
  its key, then polls until every key is there, the decision is there, or its deadline passes.
  The decision is taken once, atomically (``store.compare_set`` on an absent key): ``go`` by the
  first rank that saw every key, or an abort by the first rank whose deadline passed (naming the
  ranks that had not arrived).  Every rank follows the decision, also one that arrives later, so
  the outcome is rank-uniform: every rank returns the states, or every rank raises
  :class:`k3tail.PeerTimeout` (a rank never arrived), :class:`k3tail.PeerMismatch` (the ranks were
  at different rendezvous: their labels differ) or :class:`k3tail.PeerFault` (a rank failed
  between two rendezvous: :meth:`Comm.abandon`).  Each error names the phase (``e.phase``), the
  rank(s) and the layer.
* ``LoopbackGroup`` (rank threads of one process) runs the same protocol through a
  :class:`LocalStore` of its world.

The deadline: ``timeout_s + SLACK_S`` from this rank's arrival, ``timeout_s`` from the innermost
:func:`host_deadline` (``K3MoETail`` uses its ``timeout_s``; ``k3tail.reset`` the group's modules'),
``DEFAULT_TIMEOUT_S`` outside any.  ``SLACK_S`` covers the call that brings a peer there: a rank
whose call timed out arrives ``timeout_s`` (the group header: plus its 2 s grace) after a peer that
saw no fault, and the two still meet (2 s to spare).  :func:`host_deadline` also keeps the rendezvous rank-uniform
when a rank raises between two of them (a ``ValueError`` of its own, a failed allocation): leaving
the outermost one with an exception other than a rendezvous fault, the rank *abandons* its next
rendezvous (decides it aborted, naming itself and the exception), so its peers raise there at once
instead of waiting out their deadline, and every rank's rendezvous number stays the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from k3tail.errors import K3TailError, PeerFault, PeerMismatch, PeerTimeout

__all__ = ["Comm", "DistComm", "SoloComm", "LocalStore", "Rendezvous", "comm_for", "host_deadline",
           "current_deadline", "DEFAULT_TIMEOUT_S", "SLACK_S"]

DEFAULT_TIMEOUT_S = 60.0
SLACK_S = 4.0
_GO = b"go"


@dataclass(frozen=True)
class Deadline:
    """What the host waits of the current construction/reset wait for (:func:`host_deadline`)."""

    timeout_s: float
    slack_s: float
    layer: Optional[str]
    labels: tuple
    outer: bool  # the outermost deadline (it abandons on an exception)

    @property
    def wait_s(self) -> float:
        return self.timeout_s + self.slack_s

    def label(self, what: str) -> str:
        return " > ".join((*self.labels, what))


_current: "contextvars.ContextVar[Optional[Deadline]]" = contextvars.ContextVar("k3tail_host_deadline",
                                                                                default=None)


def current_deadline() -> Deadline:
    """The innermost :func:`host_deadline` of this thread (or the default one)."""
    d = _current.get()
    return d if d is not None else Deadline(DEFAULT_TIMEOUT_S, SLACK_S, None, (), True)


@contextlib.contextmanager
def host_deadline(comm: Optional["Comm"], timeout_s: Optional[float] = None, *, what: Optional[str] = None,
                  layer: Optional[str] = None, slack_s: Optional[float] = None):
    """Bound every host rendezvous of ``comm`` inside by ``timeout_s + slack_s`` (None: the enclosing
    deadline's, else ``DEFAULT_TIMEOUT_S`` and ``SLACK_S``); ``what`` is added to the phase that errors
    name, ``layer`` names the layer.  Leaving the outermost one with an exception that is not a
    rendezvous fault abandons ``comm``'s next rendezvous (module docstring)."""
    outer = _current.get()
    base = outer if outer is not None else current_deadline()
    d = Deadline(float(timeout_s) if timeout_s is not None else base.timeout_s,
                 float(slack_s) if slack_s is not None else base.slack_s,
                 layer if layer is not None else base.layer,
                 base.labels + ((what,) if what else ()), outer is None)
    token = _current.set(d)
    try:
        yield d
    except BaseException as e:
        if d.outer and comm is not None and getattr(e, "phase", None) is None:
            try:
                comm.abandon(e)
            except Exception:  # the store itself is gone: nothing to tell
                pass
        raise
    finally:
        _current.reset(token)


def rendezvous_error(kind: str, rank: int, world_size: int, phase: str, layer: Optional[str], *,
                     missing: Sequence[int] = (), failed: Optional[int] = None, why: str = "",
                     waited_s: float = 0.0, detector: Optional[int] = None, labels=None) -> PeerFault:
    """The error every rank raises for a failed rendezvous (the same on every rank: it comes from the
    decision they share)."""
    if kind == "timeout":
        who = f"rank(s) {', '.join(str(r) for r in missing)}" if missing else "a peer"
        by = f" (rank {detector} gave up waiting)" if detector is not None else ""
        text = f"{who} did not arrive within {waited_s:.1f} s{by}"
        return PeerTimeout(phase, rank, world_size, waited_s, reason="timeout",
                           failing_rank=missing[0] if missing else None, detected_by=detector, layer=layer,
                           phase=phase, text=text)
    if kind == "mismatch":
        lines = "; ".join(f"rank {r}: {lab}" for r, lab in enumerate(labels or ()))
        return PeerMismatch(phase, rank, world_size, reason="mismatch", layer=layer, phase=phase,
                            text=f"the ranks were at different rendezvous ({lines})")
    return PeerFault(phase, rank, world_size, reason="aborted", failing_rank=failed, detected_by=failed,
                     layer=layer, phase=phase, text=f"rank {failed} failed before this rendezvous: {why}")


class Comm:
    """The host-side collectives of construction, reset and recovery (module docstring).

    A subclass implements :meth:`exchange` (and :meth:`abandon`); the others are built on it."""

    rank: int
    world_size: int

    def exchange(self, what: str, state: Any = None) -> List[Any]:
        """Every rank's ``state`` (small, picklable), in rank order; the same on every rank, or every
        rank raises (bounded by :func:`current_deadline`).  ``what`` names the rendezvous: ranks at
        rendezvous with different names raise :class:`k3tail.PeerMismatch`."""
        raise NotImplementedError

    def abandon(self, error: BaseException) -> None:
        """This rank leaves its collective sequence with ``error``: its peers' next rendezvous fails."""

    def all_reduce_min(self, values: Sequence[int]) -> List[int]:
        rows = self.exchange(f"all_reduce_min[{len(values)}]", [int(v) for v in values])
        if len({len(r) for r in rows}) != 1:
            raise PeerMismatch("all_reduce_min", self.rank, self.world_size,
                               text=f"the ranks' vectors differ in length ({[len(r) for r in rows]})")
        return [min(col) for col in zip(*rows)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.exchange(f"broadcast_object(src={src})", obj if self.rank == src else None)[src]

    def barrier(self) -> None:
        self.exchange("barrier")


class SoloComm(Comm):
    """A world of one (``k3tail doctor`` without a process group, or W = 1)."""

    rank, world_size, name, backend = 0, 1, "solo", "solo"

    def exchange(self, what, state=None):
        return [state]


class LocalStore:
    """An in-process stand-in for a c10d store (``set``, ``get``, ``check``, ``compare_set``,
    ``delete_key``): the rank threads of a loopback world rendezvous through one."""

    def __init__(self):
        self._d: Dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value) -> None:
        with self._lock:
            self._d[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._d[key]

    def check(self, keys) -> bool:
        with self._lock:
            return all(k in self._d for k in keys)

    def compare_set(self, key: str, expected, desired) -> bytes:
        desired = desired if isinstance(desired, bytes) else str(desired).encode()
        expected = expected if isinstance(expected, bytes) else str(expected).encode()
        with self._lock:
            cur = self._d.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._d[key] = desired
                return desired
            return cur if cur is not None else expected

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._d.pop(key, None) is not None


class Rendezvous:
    """One rank's side of the host rendezvous of one group through a store (module docstring): the
    rendezvous number ``seq`` (the same on every rank) names the keys."""

    def __init__(self, store, name: str, rank: int, world_size: int):
        self.store, self.name, self.rank, self.world_size = store, name, rank, world_size
        self.seq = 0
        self.last_go = False  # the previous rendezvous completed (its keys can go)

    def _keys(self, k: int) -> tuple:
        base = f"k3tail/x/{self.name}/{k}/"
        return [base + str(r) for r in range(self.world_size)], base + "d"

    def exchange(self, what: str, state: Any = None) -> List[Any]:
        """:meth:`Comm.exchange` through the store."""
        d = current_deadline()
        label = d.label(what)
        if self.world_size == 1:
            return [state]
        store, k, W = self.store, self.seq, self.world_size
        self.seq += 1
        keys, dkey = self._keys(k)
        store.set(keys[self.rank], pickle.dumps((label, state)))
        t0 = time.monotonic()
        nap = 0.0005
        while True:
            if store.check(keys):
                decision = store.compare_set(dkey, "", _GO)
                break
            if store.check([dkey]):
                decision = store.get(dkey)
                break
            waited = time.monotonic() - t0
            if waited > d.wait_s:
                missing = [r for r in range(W) if not store.check([keys[r]])]
                decision = store.compare_set(dkey, "", pickle.dumps(("timeout", self.rank, missing, waited)))
                break
            time.sleep(nap)
            nap = min(2 * nap, 0.02)
        if decision != _GO:
            self.last_go = False
            kind, who, detail, extra = pickle.loads(decision)
            if kind == "timeout":
                raise rendezvous_error("timeout", self.rank, W, label, d.layer, missing=detail, waited_s=extra,
                                       detector=who)
            raise rendezvous_error("failed", self.rank, W, label, d.layer, failed=who, why=detail)
        got = [pickle.loads(store.get(key)) for key in keys]
        if self.last_go and k > 0:  # every rank is past rendezvous k - 1: its keys can go
            old, old_d = self._keys(k - 1)
            for key in [old[self.rank]] + ([old_d] if self.rank == 0 else []):
                try:
                    store.delete_key(key)
                except Exception:  # a store without delete: the keys stay (a few bytes each)
                    pass
        self.last_go = True
        labels = [g[0] for g in got]
        if len(set(labels)) != 1:
            raise rendezvous_error("mismatch", self.rank, W, label, d.layer, labels=labels)
        return [g[1] for g in got]

    def abandon(self, error: BaseException) -> None:
        """Decide this rank's next rendezvous aborted (naming this rank and ``error``) and skip it."""
        if self.world_size == 1:
            return
        k = self.seq
        self.seq += 1
        self.last_go = False
        _, dkey = self._keys(k)
        why = f"{type(error).__name__}: {error}"
        self.store.compare_set(dkey, "", pickle.dumps(("failed", self.rank, why[:500], 0.0)))


_rdv: Dict[tuple, Rendezvous] = {}
_rdv_lock = threading.Lock()


class DistComm(Comm):
    """A ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA); its host rendezvous go
    through the default store (module docstring), never through the group's collectives."""

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

    def _rendezvous(self) -> Rendezvous:
        """This process's rendezvous of the group (shared by every DistComm of it)."""
        store = dist.distributed_c10d._get_default_store()
        key = (str(self.name), id(store))
        with _rdv_lock:
            r = _rdv.get(key)
            if r is None:
                r = _rdv[key] = Rendezvous(store, str(self.name), self.rank, self.world_size)
        return r

    def exchange(self, what, state=None):
        return self._rendezvous().exchange(what, state)

    def abandon(self, error):
        self._rendezvous().abandon(error)


def comm_for(group) -> Comm:
    """The :class:`Comm` for a ``group=`` argument (None = the default process group)."""
    if isinstance(group, Comm):
        return group
    return DistComm(group)
