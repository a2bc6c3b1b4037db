"""Process-wide run modes every layer reads (a leaf module: it imports nothing of k3tail).

* :func:`interpret_mode`: Triton kernels run in the interpreter (CPU ranks);
* :func:`warm_only`: inside it, ``_launch.launch`` compiles and loads kernels but launches
  nothing (``LoopbackWorld.run``'s warm pass); :func:`warm_only_active` reads it.
"""

from __future__ import annotations

import contextlib
import os
import threading

# per-thread flag: ``state.warm_only`` is True inside :func:`warm_only` (``_launch._mode``)
state = threading.local()


def interpret_mode() -> bool:
    """True when Triton kernels run in the interpreter (CPU ranks)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def warm_only():
    """Inside this context ``_launch.launch`` compiles and loads kernels but launches nothing.

    ``LoopbackWorld.run`` makes one such pass over every rank before the real one: a
    module load while another virtual rank's kernel spins blocks until that kernel gives
    up (TRITON_NOTES 2; seen on the H200 as a 20 s timeout when a tail's second kernel
    was loaded while its first one spun), so every variant must be loaded before the
    first launch of any rank."""
    prev = getattr(state, "warm_only", False)
    state.warm_only = True
    try:
        yield
    finally:
        state.warm_only = prev


def warm_only_active() -> bool:
    """Is this thread inside :func:`warm_only`?"""
    return getattr(state, "warm_only", False)
