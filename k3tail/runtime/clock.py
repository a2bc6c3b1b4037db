"""The interpreter's clock page.

Under ``TRITON_INTERPRET=1`` kernels cannot read the GPU global timer, so bounded waits
read an int64 that a daemon thread of this process refreshes with ``time.monotonic_ns()``
every millisecond.  One page per process; every rank-process has its own.

The thread writes through numpy, never through torch, and stops at interpreter exit: a
daemon thread inside a torch op while the process tears down aborted it ("terminate called
without an active exception", exit code 134).
"""

import atexit
import threading
import time

import numpy as np
import torch

_lock = threading.Lock()
_page = None
_stop = threading.Event()
_thread = None


def _shutdown() -> None:
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=1.0)


def clock_page() -> torch.Tensor:
    """Return the process's clock page (an int64 CPU tensor of one element), starting it once."""
    global _page, _thread
    with _lock:
        if _page is None:
            arr = np.full(1, time.monotonic_ns(), dtype=np.int64)

            def tick():
                while not _stop.wait(0.001):
                    arr[0] = time.monotonic_ns()

            _thread = threading.Thread(target=tick, name="k3tail-clock", daemon=True)
            _thread.start()
            atexit.register(_shutdown)
            _page = torch.from_numpy(arr)  # shares arr's memory: kernels read what tick writes
    return _page
