"""A cheaper Triton interpreter for CPU ranks: :func:`install` stops the interpreter from
re-patching ``triton.language`` on every helper call inside a kernel.

Triton's interpreter (``TRITON_INTERPRET=1``) patches ``triton.language`` (and ``.core``,
``.math``, the tensor class) at each kernel launch (``GridExecutor.__call__`` calls
``_patch_lang(kernel)`` and undoes it when the launch ends), and patches again on *every* call of
a ``@triton.jit`` helper from inside the running kernel (``InterpretedFunction.__call__`` calls
``_patch_lang(helper)`` and drops the result: nothing undoes it, since the launch's own undo
restores every attribute).  When the helper's globals name no language module that the launch
has not patched already, that second patch re-sets attributes to equivalent wrappers, and it
walks the modules with ``inspect.getmembers`` each time.  k3tail's kernels call helpers in their
inner loops (the Lamport waits, the GEMM chunks): this re-patching was about 40% of a CPU rank's
time (tests/test_golden.py's world of one: 10.9 s -> 6.2 s).

:func:`install` wraps ``_patch_lang``: during a launch, a helper call whose language modules the
launch (or an earlier helper of it) already patched returns at once; any other call is Triton's
own.  Nothing else changes: the values a kernel computes are the same bit for bit
(tests/test_interp.py compares with and without; tests/test_golden.py's recording predates it).

``import k3tail`` installs it when the interpreter is on, unless ``K3TAIL_INTERP_FAST=0``; a
Triton whose interpreter lacks these internals is left alone (``install`` returns False).
Spawned CPU ranks import k3tail, so they get it too.  Not thread-safe, like the interpreter
itself (concurrent launches from threads crash it: TRITON_NOTES 4).

Tried and taken out again (b589b4f): a 1 ms sleep at each poll of a waiting program (its second and
later clock-page reads).  It halved some W = 3 tests, but the whole suite was not faster (1027 s
without it, 1061 s and 1158 s with it, on the 2-core machine), and the changed timing let a rank
run ahead often enough to show a race in CI (tests/test_pairing.py::test_faults_lamport_tiers_cpu[3]:
a lagging rank's last kernel of call n - 1 refused to start on the fault word that a peer's call n
had just posted; issue 32's note).
"""

from __future__ import annotations

import inspect
import logging
import os

log = logging.getLogger("k3tail")

_state = {"orig": None, "active": [], "langs": {}}


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
    entry = [mine]
    active.append(entry)
    undo = scope.restore

    def restore():
        if entry in active:
            active.remove(entry)
        undo()

    scope.restore = restore
    return scope


def installed() -> bool:
    try:
        import triton.runtime.interpreter as I
    except ImportError:  # pragma: no cover - triton is a dependency
        return False
    return getattr(I, "_patch_lang", None) is _memo_patch_lang


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (idempotent).  False when this Triton's interpreter
    does not have the internals this relies on (then nothing is changed)."""
    if installed():
        return True
    try:
        import triton.runtime.interpreter as I
    except ImportError:  # pragma: no cover
        return False
    orig = getattr(I, "_patch_lang", None)
    if (orig is None or not hasattr(I, "InterpretedFunction") or not hasattr(I, "GridExecutor")
            or list(inspect.signature(orig).parameters) != ["fn"]):
        log.debug("k3tail: this Triton's interpreter has no _patch_lang(fn); left as it is")
        return False
    _state["orig"] = orig
    I._patch_lang = _memo_patch_lang
    return True


def uninstall() -> None:
    """Put Triton's own ``_patch_lang`` back (tests compare the two)."""
    if installed():
        import triton.runtime.interpreter as I
        I._patch_lang = _state["orig"]
        _state["active"].clear()


def wanted() -> bool:
    """Install at ``import k3tail``?  Under the interpreter, unless ``K3TAIL_INTERP_FAST=0``."""
    return (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            and os.environ.get("K3TAIL_INTERP_FAST", "1") not in ("", "0"))
