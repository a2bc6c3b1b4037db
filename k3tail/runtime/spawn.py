"""``k3tail.spawn``: run a function on W fresh rank processes with torch.distributed initialized.

Placement (:func:`spawn_plan`):

* ``device="cpu"``: gloo, ``TRITON_INTERPRET=1`` (kernels run in Triton's interpreter on
  shared memory), one thread per process.
* ``device="cuda"``, W <= number of visible GPUs: one process per GPU, rank r on cuda:r,
  NCCL.
* ``device="cuda"``, W > number of GPUs (one H200: W = 2, 4, 8 processes): every rank on
  cuda:0, a gloo group (NCCL refuses two ranks on one device) and
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, so torch symmetric memory rendezvous
  across processes that share the GPU.  The processes time-share the GPU: every protocol,
  allocation and CUDA graph runs for real, but spinning kernels of different processes do
  not run concurrently, so latencies mean nothing there.

Every rank gets ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0``,
``NVSHMEM_DISABLE_NVLS=1`` (DESIGN §8: never NVLink multicast).

What a rank inherits: ``sys.path`` (multiprocessing's spawn start method), the environment plus
the plan's variables, and the logging setup: where this process configured logging (root
handlers, as ``logging.basicConfig`` or ``k3tail -v`` do) each rank configures the same level
and format, prefixed with its rank, so ``k3tail -v demo`` shows the ranks' INFO logs.  ``fn``
and ``args`` travel pickled as bytes and are unpickled inside the rank's error handling: a
function the fresh process cannot import (defined under ``python -c``, in a notebook) fails with
the real ``AttributeError`` / ``ImportError`` in the :class:`SpawnError`, not a bare exit code.

Cleanup: each rank process leads its own process group (``setpgid``) and dies with the
parent (``PR_SET_PDEATHSIG``).  The parent learns exit statuses with ``waitid(WNOWAIT)``, so
no rank is reaped before the end; then it SIGKILLs every rank's whole process group (a
rank's own children included: no orphan survives, and the group id cannot have been reused
while its leader is an unreaped child), reaps the ranks and removes the rendezvous file and
the run's ``/dev/shm/k3tail-<tag>-*`` segments.  A GPU's memory is freed by the driver when
the processes that held it are gone.
"""

from __future__ import annotations

import ctypes
import glob
import io
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Optional

from k3tail.errors import K3TailError

# Never let a spawned process use NVLink multicast (DESIGN §8).
NO_MULTICAST_ENV = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OVERLAP_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


class SpawnError(K3TailError):
    """A :func:`spawn` run failed.  ``errors``: rank -> traceback text of ranks that raised;
    ``signals``: rank -> signal name of ranks killed by a signal (not by spawn);
    ``exitcodes``: rank -> exit code of ranks that exited without a result; ``killed``:
    ranks still running at the deadline, killed by spawn; ``pids``: every rank's pid."""

    def __init__(self, msg: str, *, world_size: int, errors=None, signals=None, exitcodes=None,
                 killed=(), pids=()):
        super().__init__(msg)
        self.world_size = world_size
        self.errors: Dict[int, str] = dict(errors or {})
        self.signals: Dict[int, str] = dict(signals or {})
        self.exitcodes: Dict[int, int] = dict(exitcodes or {})
        self.killed: List[int] = list(killed)
        self.pids: List[int] = list(pids)


@dataclass(frozen=True)
class SpawnPlan:
    """Where :func:`spawn` puts the ranks: ``mode`` "cpu", "per_gpu" or "overlapping",
    the process-group ``backend``, each rank's CUDA device index (None on CPU) and the
    environment every rank gets (the no-multicast switches included)."""

    mode: str
    backend: str
    devices: tuple
    env: Dict[str, str] = field(default_factory=dict)


def spawn_plan(world_size: int, device: str = "cpu", backend: Optional[str] = None,
               env: Optional[dict] = None) -> SpawnPlan:
    """The placement :func:`spawn` uses (see the module docstring); raises without CUDA."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    out = {**(env or {}), **NO_MULTICAST_ENV}
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("backend='nccl' needs device='cuda'")
        out.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        return SpawnPlan("cpu", "gloo", (None,) * world_size, out)
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise K3TailError("spawn(device='cuda'): no CUDA device is visible here; use device='cpu' "
                          "(CPU rank processes, kernels in Triton's interpreter)")
    if world_size <= n:
        return SpawnPlan("per_gpu", backend or "nccl", tuple(range(world_size)), out)
    if backend == "nccl":
        raise ValueError(f"spawn: {world_size} ranks on {n} GPU(s) share cuda:0, and NCCL refuses two "
                         f"ranks on one device; use backend='gloo' (the default there)")
    out.update(OVERLAP_ENV)
    return SpawnPlan("overlapping", backend or "gloo", (0,) * world_size, out)


def _die_with_parent(parent_pid: int) -> None:
    """Own process group; SIGKILL when the parent dies (Linux; elsewhere a no-op)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def logging_setup() -> Optional[Dict[str, Any]]:
    """This process's logging setup as a rank process should copy it: None where nothing was
    configured (no root handler, no level on the ``k3tail`` logger); else the root level and the
    first root handler's format, and the ``k3tail`` logger's own level."""
    root, lg = logging.getLogger(), logging.getLogger("k3tail")
    if not root.handlers and lg.level == logging.NOTSET:
        return None
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None
                and getattr(h.formatter, "_fmt", None)), None)
    return {"root_level": root.level, "k3tail_level": lg.level, "format": fmt, "handlers": bool(root.handlers)}


def _apply_logging(setup: Optional[Dict[str, Any]], rank: int) -> None:
    if setup is None:
        return
    if setup["handlers"]:
        logging.basicConfig(level=setup["root_level"], format=f"[rank {rank}] " + (setup["format"] or
                                                                                 logging.BASIC_FORMAT))
    if setup["k3tail_level"] != logging.NOTSET:
        logging.getLogger("k3tail").setLevel(setup["k3tail_level"])


UNPICKLE_HINT = ("a fresh process imports fn by its module and name: fn must be a module-level function of a "
                 "module the ranks can import (not one defined under `python -c` or in a notebook)")


def _child(rank, world_size, cuda_index, backend, init_file, env, parent_pid, payload, log_setup, conn):
    _die_with_parent(parent_pid)
    os.environ.update(env)
    try:
        _apply_logging(log_setup, rank)
        try:
            fn, args = ForkingPickler.loads(payload)
        except Exception as e:  # noqa: BLE001 - reported to the parent with the hint
            raise SpawnError(f"could not unpickle fn or its args ({type(e).__name__}: {e}); {UNPICKLE_HINT}",
                             world_size=world_size) from e
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if cuda_index is not None:
            torch.cuda.set_device(cuda_index)
        kw = {}
        if backend == "nccl":
            kw["device_id"] = torch.device("cuda", cuda_index)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, **kw)
        if backend == "gloo":
            # Gloo's init returns on a rank once *its* pairs are up, not everyone's: a rank whose
            # fn fails at once could otherwise close a pair another rank is still connecting, and
            # that rank would report a Gloo error instead of being named as still running.
            dist.barrier()
        try:
            result = fn(rank, world_size, *args)
            buf = io.BytesIO()
            torch.save(result, buf)
            conn.send(("ok", buf.getvalue()))
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
    finally:
        conn.close()


def _exit_status(proc) -> Optional[int]:
    """The exit status of rank process ``proc`` (multiprocessing's convention: -N for signal
    N), or None while it runs.  Never reaps it (``WNOWAIT``): its pid, and so its process
    group id, stay reserved until :func:`spawn` kills the group and joins it."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (multiprocessing reaps finished children in start())
        return proc.exitcode
    if info is None or info.si_pid == 0:
        return None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return -info.si_status
    return info.si_status


def _unreaped(proc) -> bool:
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def spawn(world_size: int, fn: Callable[..., Any], *args, device: str = "cpu",
          timeout: float = 300.0, backend: str = None, env: dict = None,
          grace: float = GRACE_S) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    Placement by :func:`spawn_plan`: ``device="cpu"``: gloo + Triton interpreter;
    ``device="cuda"``: one process per GPU with NCCL (rank r on cuda:r) when there are
    enough GPUs, else every rank on cuda:0 with gloo and torch symmetric memory's
    overlapping-devices mode.  ``backend`` overrides the process-group backend; ``env``
    adds variables to every rank's environment.  ``fn`` and ``args`` must be picklable, and
    ``fn`` importable by a fresh process (a module-level function of an importable module);
    the ranks copy this process's logging setup (:func:`logging_setup`).  ``fn`` starts on a rank
    once every rank's process group is up (with gloo, a barrier after the init).

    Returns the per-rank return values in rank order; tensors come back on the CPU (they
    are serialized, so they outlive the child).  Failure raises :class:`SpawnError` (a
    :class:`K3TailError`) naming the ranks: a rank killed by a signal (with the signal), a
    rank that exited without a result (with its exit code), a rank that raised (with its
    traceback); the other ranks get ``grace`` seconds more, then are killed and named.
    Ranks still running ``timeout`` seconds after the start are killed and reported.
    No process (a rank's own children included), rendezvous file or shared-memory segment
    of the run is left behind.
    """
    plan = spawn_plan(world_size, device, backend, env)
    if not callable(fn):
        raise ValueError("fn must be callable")
    try:
        payload = bytes(ForkingPickler.dumps((fn, args)))
    except Exception as e:  # a lambda, a local function, an unpicklable argument
        raise ValueError(f"spawn: fn and args must be picklable (a module-level function; {type(e).__name__}: "
                         f"{e})") from e
    log_setup = logging_setup()
    import torch

    ctx = mp.get_context("spawn")
    tag = uuid.uuid4().hex[:10]
    shm_prefix = f"k3tail-{tag}-"
    env = dict(plan.env, K3TAIL_SHM_PREFIX=shm_prefix)
    fd, init_file = tempfile.mkstemp(prefix=f"k3tail-{tag}-", suffix=".rdzv")
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"k3tail-rank{rank}",
                            args=(rank, world_size, plan.devices[rank], plan.backend, init_file, env,
                                  os.getpid(), payload, log_setup, child_end),
                            daemon=True)
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        pids = [p.pid for p in procs]
        results: List[Any] = [None] * world_size
        errors: Dict[int, str] = {}
        died: Dict[int, int] = {}  # rank -> exit status, ranks gone without a result
        deadline = time.monotonic() + timeout
        pending = {conns[r]: r for r in range(world_size)}

        def failed():  # the others get `grace` seconds more
            nonlocal deadline
            deadline = min(deadline, time.monotonic() + grace)

        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for c in mp_wait(list(pending), timeout=min(left, 0.5)):
                r = pending.pop(c)
                try:
                    kind, msg = c.recv()
                except EOFError:  # gone without a word: find out how (it may still be exiting)
                    code = None
                    t_end = time.monotonic() + 5.0
                    while code is None and time.monotonic() < t_end:
                        code = _exit_status(procs[r])
                        if code is None:
                            time.sleep(0.02)
                    died[r] = 255 if code is None else code
                    failed()
                    continue
                if kind == "ok":
                    results[r] = torch.load(io.BytesIO(msg), map_location="cpu", weights_only=False)
                else:
                    errors[r] = msg
                    failed()
            for c, r in list(pending.items()):  # a rank whose pipe a descendant keeps open
                code = _exit_status(procs[r])
                if code is not None and not c.poll():
                    pending.pop(c)
                    died[r] = code
                    failed()
        killed = sorted(pending.values())
        if errors or died:
            raise _failure(world_size, errors, died, killed, pids)
        if killed:
            raise SpawnError(f"ranks {killed} of {world_size} still running after {timeout:.0f} s: killed",
                             world_size=world_size, killed=killed, pids=pids)
        return results
    finally:
        for p in procs:  # whole process groups, while every rank is still unreaped
            if p.pid is not None and _unreaped(p):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        for c in conns:
            c.close()
        for path in glob.glob(f"/dev/shm/{shm_prefix}*") + glob.glob(init_file + "*"):
            try:
                os.unlink(path)
            except OSError:
                pass


def _failure(W: int, errors: Dict[int, str], died: Dict[int, int], killed: List[int], pids) -> SpawnError:
    signals = {r: _signal_name(-c) for r, c in died.items() if c < 0}
    exitcodes = {r: c for r, c in died.items() if c >= 0}
    lines = [f"rank {r} of {W} was killed by signal {signals[r]} (not by spawn)" for r in sorted(signals)]
    lines += [f"rank {r} of {W} exited with code {exitcodes[r]} without a result" for r in sorted(exitcodes)]
    first = min(errors) if errors else None
    if first is not None:
        others = [f"rank {r} raised {_first_line(errors[r])}" for r in sorted(errors) if r != first]
        lines.append(f"rank {first} of {W} raised" + (f" (also: {'; '.join(others)})" if others else "")
                     + f":\n{errors[first]}")
    if killed:
        lines.append(f"ranks {killed} were still running and were killed")
    return SpawnError("; ".join(lines[:1]) + "".join("\n" + x for x in lines[1:]), world_size=W,
                      errors=errors, signals=signals, exitcodes=exitcodes, killed=killed, pids=pids)
