"""probe_p2p: does a write through the peer table arrive?  (kernel and protocol: triton_kernels/p2p_probe.py)

Drivers can report P2P that silently drops writes, so the capability vote (``k3tail.vote``) asks
this op instead of the driver.  Test hook: ``K3TAIL_FAKE_P2P_FAIL=1`` makes this rank take part in
the exchange (so its peers are not stranded) and then report failure.
"""

from __future__ import annotations

import os
import threading
from typing import Tuple

import torch

from k3tail.runtime import launch as L
from k3tail.runtime.comm import Comm
from k3tail.runtime.loopback import LoopbackGroup
from k3tail.runtime.workspace import create_workspace, resolve_device
from k3tail.triton_kernels.p2p_probe import p2p_probe_kernel

ENV_FAKE_P2P_FAIL = "K3TAIL_FAKE_P2P_FAIL"
SLOT = 8
_KERNEL = L.kernel(p2p_probe_kernel)
_lock = threading.Lock()  # loopback ranks are threads: serialize compile and launch


def _pattern(src: int, dst: int) -> torch.Tensor:
    return src * 65536 + dst * 256 + torch.arange(SLOT, dtype=torch.int32) + 1


def probe_p2p(group, comm: Comm, device: torch.device, env=None) -> Tuple[int, int, str]:
    """Write/read through the peer table.  Returns ``(p2p, multicast, why_not)``.

    Collective over the group: it allocates the probe workspace on ``device`` (the device the ops
    will use, never one guessed from the group's backend), unconditionally, on every rank.  Never
    spins: remote stores, device sync, a host barrier, then a local check."""
    env = env if env is not None else os.environ
    W = comm.world_size
    if W == 1:
        return 1, 0, ""
    nbytes = W * SLOT * 4
    dev = resolve_device(comm, device)
    ws = create_workspace(group, nbytes, device=dev, what="k3tail.p2p_probe", arm32=((0, 4096),))
    ok, why = True, ""
    try:
        launch = _KERNEL.variant(num_warps=4, W=W, SLOT=SLOT)
        stream = comm.stream if isinstance(comm, LoopbackGroup) else None
        with _lock:
            if stream is not None:
                with torch.cuda.stream(stream):
                    launch((1,), ws.table, ws.rank)
                stream.synchronize()
            else:
                launch((1,), ws.table, ws.rank)
                if ws.device.type == "cuda":
                    torch.cuda.synchronize(ws.device)
    except Exception as e:  # a launch that fails here must still meet the barrier
        ok, why = False, f"probe kernel failed: {type(e).__name__}: {e}"
    comm.barrier()
    if ok:
        got = ws.local[:nbytes].view(torch.int32).cpu().view(W, SLOT)
        want = torch.stack([_pattern(s, ws.rank) for s in range(W)])
        bad = [s for s in range(W) if not torch.equal(got[s], want[s])]
        if bad:
            ok, why = False, f"writes from ranks {bad} through the peer table did not arrive"
    if ok and env.get(ENV_FAKE_P2P_FAIL, "0") not in ("", "0"):
        ok, why = False, f"{ENV_FAKE_P2P_FAIL}=1 (test hook)"
    mc = 1 if (ws.multicast_ptr != 0 and env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0") in ("", "0")) else 0
    return int(ok), mc, why
