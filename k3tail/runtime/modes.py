"""Process-wide run modes every layer reads (a leaf module: it imports nothing of k3tail).

* :func:`interpret_mode`: Triton kernels run in the interpreter (CPU ranks);
* :func:`env_flag`: an environment switch, read once per process;
* :func:`warm_only`: inside it, ``_launch.launch`` compiles and loads kernels but launches
  nothing (``LoopbackWorld.run``'s warm pass); :func:`warm_only_active` reads it.
"""

from __future__ import annotations

import contextlib
import os
import threading

# per-thread flag: ``state.warm_only`` is True inside :func:`warm_only` (``_launch._mode``)
state = threading.local()


_flags: dict = {}  # environment switches, read once per process (:func:`env_flag`)


def env_flag(name: str) -> bool:
    """Is the environment switch ``name`` on (set and not ``""`` / ``"0"``)?  Read on first use and
    kept: every eager call asks several of these, and an ``os.environ`` read costs about 1 us of host
    time (issue 30).  :func:`reread_env` forgets what was read (tests; a process that changes a
    switch after its first call)."""
    v = _flags.get(name)
    if v is None:
        v = _flags[name] = os.environ.get(name, "0") not in ("", "0")
    return v


def reread_env() -> None:
    """Read the environment switches again at their next use (:func:`env_flag`)."""
    _flags.clear()


def interpret_mode() -> bool:
    """True when Triton kernels run in the interpreter (CPU ranks): ``TRITON_INTERPRET``, read once
    (Triton itself decides it when it decorates a kernel, at import: a later change of the variable
    would not change how the kernels run)."""
    return env_flag("TRITON_INTERPRET")


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
