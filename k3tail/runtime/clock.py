"""The interpreter's clock page.

Under ``TRITON_INTERPRET=1`` kernels cannot read the GPU global timer, so bounded waits
read an int64 that a daemon thread of this process refreshes with ``time.monotonic_ns()``
every millisecond.  One page per process; every rank-process has its own.

The thread writes through numpy, never through torch, and stops at interpreter exit: a
daemon thread inside a torch op while the process tears down aborted it ("terminate called
without an active exception", exit code 134).  A forked child inherits the page but not the thread:
the child starts its own (``os.register_at_fork``), else its waits would read a frozen clock and
never reach their deadlines.
"""

import atexit
import os
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


def _start(arr: np.ndarray) -> None:
    """Start the thread that refreshes ``arr`` (the page's memory) every millisecond."""
    global _thread

    def tick():
        while not _stop.wait(0.001):
            arr[0] = time.monotonic_ns()

    arr[0] = time.monotonic_ns()
    _thread = threading.Thread(target=tick, name="k3tail-clock", daemon=True)
    _thread.start()


def _after_fork_in_child() -> None:
    global _lock, _stop
    _lock, _stop = threading.Lock(), threading.Event()  # (the parent's may have been held at the fork)
    if _page is not None:
        _start(_page.numpy())  # the child's copy of the page: same tensor, its own thread


def clock_page() -> torch.Tensor:
    """Return the process's clock page (an int64 CPU tensor of one element), starting it once."""
    global _page
    with _lock:
        if _page is None:
            arr = np.full(1, time.monotonic_ns(), dtype=np.int64)
            _start(arr)
            atexit.register(_shutdown)
            _page = torch.from_numpy(arr)  # shares arr's memory: kernels read what tick writes
    return _page


os.register_at_fork(after_in_child=_after_fork_in_child)
