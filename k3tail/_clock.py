"""The interpreter's clock page.

Under ``TRITON_INTERPRET=1`` kernels cannot read the GPU global timer, so bounded waits
read an int64 that a daemon thread of this process refreshes with ``time.monotonic_ns()``
every millisecond.  One page per process; every rank-process has its own.
"""

import threading
import time

import torch

_lock = threading.Lock()
_page = None


def clock_page() -> torch.Tensor:
    """Return the process's clock page (an int64 CPU tensor of one element), starting it once."""
    global _page
    with _lock:
        if _page is None:
            page = torch.full((1,), time.monotonic_ns(), dtype=torch.int64)

            def tick():
                while True:
                    page[0] = time.monotonic_ns()
                    time.sleep(0.001)

            threading.Thread(target=tick, name="k3tail-clock", daemon=True).start()
            _page = page
    return _page
