"""A cheaper Triton interpreter for CPU ranks (:func:`install`): the same values, less CPU time.

Two changes, both in how the interpreter runs, never in what a kernel computes:

1. **No re-patching on helper calls.**  Triton's interpreter (``TRITON_INTERPRET=1``) patches
   ``triton.language`` (and ``.core``, ``.math``, the tensor class) at each kernel launch
   (``GridExecutor.__call__`` calls ``_patch_lang(kernel)`` and undoes it when the launch ends), and
   again on *every* call of a ``@triton.jit`` helper from inside the running kernel
   (``InterpretedFunction.__call__`` calls ``_patch_lang(helper)`` and drops the result: nothing
   undoes it, since the launch's own undo restores every attribute).  When the helper's globals name
   no language module that the launch has not patched already, that second patch re-sets attributes
   to equivalent wrappers, walking the modules with ``inspect.getmembers`` each time.  k3tail's
   kernels call helpers in their inner loops (the Lamport waits, the GEMM chunks): this was about
   40% of a world of one's time (tests/test_golden.py, W = 1: 10.9 s -> 6.2 s).  The wrapped
   ``_patch_lang`` returns at once for such a helper call; any other call is Triton's own.
2. **A polling rank yields its core.**  Every bounded wait reads the interpreter's clock page
   (:mod:`k3tail.runtime.clock`) once per poll (and once for its deadline).  A program's second and
   later reads in one launch now sleep ``POLL_SLEEP_S`` (1 ms) first, so that a rank spinning for
   its peers leaves the CPU to them (a program that reads only its deadline is not slowed): CPU
   ranks outnumber the cores (CI has 2), and a spinning rank took a full share from the ranks it
   waited for.  Deadlines are wall-clock times: a wait ends by its deadline as before, a poll or so
   later.

Both together, on this project's 2-core machine (golden W = 1, 2, 3, module equivalence W = 2, 4,
the tail at W = 2, every tier at W = 3, the tree's one-token test, the finalize tests): 405 s with
``K3TAIL_INTERP_FAST=0``, 232 s with it on; golden W = 3 alone 87 s -> 39 s.

Nothing else changes: the bits are the same (tests/test_interp.py compares with and without;
tests/test_golden.py's recording predates this module).  ``import k3tail`` installs both when the
interpreter is on, unless ``K3TAIL_INTERP_FAST=0``; a Triton whose interpreter lacks the internals
used here is left alone (``install`` returns False).  Spawned CPU ranks import k3tail, so they get it
too.  Not thread-safe, like the interpreter itself (concurrent launches from threads crash it:
TRITON_NOTES 4).
"""

from __future__ import annotations

import inspect
import logging
import os
import time

log = logging.getLogger("k3tail")

POLL_SLEEP_S = 0.001
_state = {"orig": None, "active": [], "langs": {}, "load": None, "polls": 0, "launch": 0, "last_read": None}


def _langs(fn, tl) -> frozenset:
    """The ids of the language modules (``triton.language``, ``triton.language.core``) that
    ``_patch_lang(fn)`` would patch: those bound in ``fn``'s globals."""
    got = _state["langs"].get(fn)
    if got is None:
        got = frozenset(id(v) for v in list(fn.__globals__.values())
                        if inspect.ismodule(v) and (v is tl or v is tl.core))
        _state["langs"][fn] = got
    return got


class _Done:
    """What a skipped patch returns (Triton drops a helper call's result anyway)."""

    def restore(self) -> None:
        pass


def _memo_patch_lang(fn):
    import triton.language as tl

    orig, active = _state["orig"], _state["active"]
    mine = _langs(fn, tl)
    if active:  # a helper called by the running launch
        covered = active[-1]
        if mine <= covered[0]:
            return _Done()
        scope = orig(fn)
        covered[0] = covered[0] | mine
        return scope
    scope = orig(fn)  # a launch: Triton's patch, undone by the launch's scope.restore()
    _state["launch"] += 1
    entry = [mine]
    active.append(entry)
    undo = scope.restore

    def restore():
        if entry in active:
            active.remove(entry)
        undo()

    scope.restore = restore
    return scope


def _poll_sleep_load(orig_load):
    from k3tail.runtime import clock

    def create_masked_load(self, ptrs, *args, **kw):
        page = clock._page
        if page is not None and ptrs.data.size == 1 and int(ptrs.data.flat[0]) == page.data_ptr():
            # the first read of a program (its deadline) goes at once; a later one is a poll
            key = (_state["launch"], getattr(self, "grid_idx", None))
            if key == _state["last_read"]:
                _state["polls"] += 1
                time.sleep(POLL_SLEEP_S)
            _state["last_read"] = key
        return orig_load(self, ptrs, *args, **kw)

    create_masked_load.__k3tail__ = True
    return create_masked_load


def installed() -> bool:
    try:
        import triton.runtime.interpreter as I
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    return getattr(I, "_patch_lang", None) is _memo_patch_lang


def install() -> bool:
    """Install both changes (idempotent).  False when this Triton's interpreter does not have the
    internals they rely on (then nothing is changed)."""
    if installed():
        return True
    try:
        import triton.runtime.interpreter as I
    except ImportError:  # pragma: no cover
        return False
    orig = getattr(I, "_patch_lang", None)
    builder = type(getattr(I, "interpreter_builder", None))
    load = getattr(builder, "create_masked_load", None)
    if (orig is None or load is None or not hasattr(I, "InterpretedFunction") or not hasattr(I, "GridExecutor")
            or list(inspect.signature(orig).parameters) != ["fn"]
            or list(inspect.signature(load).parameters)[:2] != ["self", "ptrs"]):
        log.debug("k3tail: this Triton's interpreter lacks _patch_lang(fn) or create_masked_load(ptrs, ...); "
                  "left as it is")
        return False
    _state["orig"], _state["load"] = orig, load
    I._patch_lang = _memo_patch_lang
    builder.create_masked_load = _poll_sleep_load(load)
    return True


def uninstall() -> None:
    """Put Triton's own functions back (tests compare the two)."""
    if installed():
        import triton.runtime.interpreter as I
        I._patch_lang = _state["orig"]
        type(I.interpreter_builder).create_masked_load = _state["load"]
        _state["active"].clear()


def polls() -> int:
    """How many clock-page reads slept in this process (a polling wait's iterations)."""
    return _state["polls"]


def wanted() -> bool:
    """Install at ``import k3tail``?  Under the interpreter, unless ``K3TAIL_INTERP_FAST=0``."""
    return (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            and os.environ.get("K3TAIL_INTERP_FAST", "1") not in ("", "0"))
