"""``k3tail.spawn``: run a function on W fresh rank processes with torch.distributed initialized."""

from __future__ import annotations

import glob
import io
import multiprocessing as mp
import os
import tempfile
import time
import traceback
import uuid
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, List

from .errors import K3TailError

# Never let a spawned process use NVLink multicast (DESIGN §8).
NO_MULTICAST_ENV = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_GRACE_S = 10.0


def _child(rank, world_size, device, backend, init_file, env, fn, args, conn):
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if backend == "nccl":
            dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size)
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


def spawn(world_size: int, fn: Callable[..., Any], *args, device: str = "cpu",
          timeout: float = 300.0, backend: str = None, env: dict = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    ``device="cpu"``: gloo, ``TRITON_INTERPRET=1`` (kernels run in Triton's interpreter on
    shared memory).  ``device="cuda"``: NCCL, one GPU per rank (rank % device_count).
    ``backend`` overrides the process-group backend (e.g. gloo for several CUDA ranks on
    one GPU, which NCCL refuses); ``env`` adds variables to every rank's environment.
    Returns the per-rank return values in rank order; tensors come back on the CPU (they
    are serialized, so they outlive the child).  If a rank raises, raises
    :class:`K3TailError` naming the rank with its traceback; ranks still running
    ``timeout`` seconds after the start (or 10 s after another rank failed) are killed and
    reported.  No process or shared-memory segment is left behind.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not callable(fn):
        raise ValueError("fn must be callable")
    import torch

    ctx = mp.get_context("spawn")
    tag = uuid.uuid4().hex[:10]
    shm_prefix = f"k3tail-{tag}-"
    if backend is None:
        backend = "nccl" if device == "cuda" else "gloo"
    env = {**(env or {}), **NO_MULTICAST_ENV}
    env["K3TAIL_SHM_PREFIX"] = shm_prefix
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    fd, init_file = tempfile.mkstemp(prefix=f"k3tail-{tag}-", suffix=".rdzv")
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"k3tail-rank{rank}",
                            args=(rank, world_size, device, backend, init_file, env, fn, args, child_end),
                            daemon=True)
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        results: List[Any] = [None] * world_size
        status = ["running"] * world_size
        errors = {}
        deadline = time.monotonic() + timeout
        pending = {conns[r]: r for r in range(world_size)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for c in mp_wait(list(pending), timeout=min(left, 1.0)):
                r = pending.pop(c)
                try:
                    kind, payload = c.recv()
                except EOFError:
                    kind, payload = "err", f"rank process exited with code {procs[r].exitcode} without a result"
                if kind == "ok":
                    results[r] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
                    status[r] = "ok"
                else:
                    errors[r] = payload
                    status[r] = "error"
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
        for c, r in pending.items():
            status[r] = "killed"
        if errors:
            r = min(errors)
            killed = [k for k, s in enumerate(status) if s == "killed"]
            extra = f"; ranks {killed} were still running and were killed" if killed else ""
            raise K3TailError(f"rank {r} of {world_size} raised{extra}:\n{errors[r]}")
        if pending:
            killed = sorted(pending.values())
            raise K3TailError(f"ranks {killed} of {world_size} still running after {timeout:.0f} s: killed")
        return results
    finally:
        for p in procs:
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
