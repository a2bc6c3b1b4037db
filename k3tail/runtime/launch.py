"""Kernel launch: every variant compiled and loaded once, then launched without Triton's generic dispatcher.

Why.  ``kernel[grid](*args, **constexprs)`` binds the arguments, builds a cache key from every
argument's specialization and the options, looks the compiled kernel up, checks the globals it
used and only then launches: about 27 us of host time per launch on the H200 machine (issue 19),
more than many of the tail's kernels take on the GPU.  Here a :class:`Variant` is one kernel
with its compile-time values (constexprs, ``num_warps``, ``num_stages``, PDL) fixed when an op
builds it; a call computes only what Triton specializes on from the runtime arguments (the
*signature*, :func:`spec_key`), finds the compiled kernel of that signature in a dict and calls
its launcher directly.

The Triton-version shim is this file alone (tested with Triton 3.6 through 3.9, whose
``CompiledKernel.run`` and specialization rules are the same):

* ``CompiledKernel.run(grid_0, grid_1, grid_2, stream, function, packed_metadata,
  launch_metadata, launch_enter_hook, launch_exit_hook, *all_args)`` with every declared argument
  in order, constexprs included (what ``JITFunction.run`` calls after dispatch);
* the specialization of a runtime argument (``native_specialize_impl``): a tensor by its dtype and
  whether its address is 16-byte aligned; an int by its width class (i32, i64, u64) and, unless
  the kernel marks it ``do_not_specialize``, by ``== 1`` and ``% 16 == 0``; a bool, a float and
  None by their type.  :func:`spec_key` mirrors it; ``tests/test_launch.py`` checks it against
  the installed Triton's own function.
* When a launch hook is installed (a profiler such as proton), calls take Triton's own path, and so
  do they with ``K3TAIL_TRITON_DISPATCH=1`` (the escape hatch should a Triton release change any of
  the above).  Triton 3.5+ keeps an empty ``HookChain`` in ``knobs.runtime`` at all times: only a
  chain with hooks in it is a hook (:func:`launch_hooks_installed`).

Loading a module while another virtual rank's kernel spins can hang the process (TRITON_NOTES 2),
so a variant is compiled and loaded on first use, before it launches, and inside
:func:`k3tail.runtime.modes.warm_only` it is compiled and loaded but not launched
(``LoopbackWorld.run``'s warm pass and ``K3MoETail.warmup``).  Under the interpreter
(``TRITON_INTERPRET=1``) nothing is compiled: a variant calls ``kernel[grid](...)``.

Also here: the launch-time facts every op needs, cached per device (PDL, the grid cap of
spinning kernels, the interpreter's clock page) and the check after an interpreted launch.
"""

from __future__ import annotations

import inspect
import operator
import os
import threading
from typing import Callable, Dict, Optional, Sequence

import torch

from k3tail.runtime.clock import clock_page
from k3tail.runtime.loopback import LoopbackGroup
from k3tail.runtime.modes import env_flag, interpret_mode, warm_only_active
from k3tail.runtime.workspace import Workspace

_I32 = (-(2 ** 31), 2 ** 31 - 1)
_observer: Optional[Callable] = None  # tests: sees every launch (kernel, grid, args, options, constexprs)


def set_observer(fn: Optional[Callable]) -> Optional[Callable]:
    """Install ``fn(kernel, grid, args, options, constexprs)``, called before every launch (tests use it
    to record the variants that ran); returns the previous observer."""
    global _observer
    prev, _observer = _observer, fn
    return prev


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _int_class(v: int) -> int:
    """Triton's width class of an int argument: 0 i32, 1 i64, 2 u64 (the part of :func:`spec_key` that
    a ``do_not_specialize`` int keeps)."""
    return 0 if _I32[0] <= v <= _I32[1] else (2 if 2 ** 63 <= v <= 2 ** 64 - 1 else 1)


def _getter(pos: tuple) -> Callable[[tuple], tuple]:
    """``args -> tuple(args[i] for i in pos)`` at C speed (``itemgetter`` of one index returns the
    item itself, not a 1-tuple)."""
    if len(pos) == 1:
        i = pos[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*pos)


_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_IS_CUDA = operator.attrgetter("is_cuda")


def _is_descriptor_type(t: type) -> bool:
    """Is ``t`` Triton's host TMA descriptor class (or a subclass)?  Asked once per tuple of argument
    types (:meth:`Variant._layout`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return issubclass(t, TensorDescriptor)


def spec_key(arg, specialize: bool):
    """What Triton 3.6-3.9 specialize a kernel on for one runtime argument (see the module docstring)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, specialize and arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg)
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):  # a host TMA descriptor: its dtype and box
        return (type(arg), arg.base.dtype, tuple(arg.block_shape))
    if isinstance(arg, int):
        cls = _int_class(arg)
        if not specialize:
            return cls
        return (cls, arg == 1, arg % 16 == 0)
    return type(arg)


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - Triton < 3.4 is outside the supported range
    _knobs = None


def _hook_active(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # Triton >= 3.5: a HookChain, always there, empty unless added to
    return bool(calls) if isinstance(calls, list) else True


ENV_TRITON_DISPATCH = "K3TAIL_TRITON_DISPATCH"  # "1": every launch through Triton's own dispatcher


def generic_dispatch() -> bool:
    """Do launches take Triton's own path (``kernel[grid](...)``)?  When a launch hook is installed
    (:func:`launch_hooks_installed`, checked per launch), or when ``K3TAIL_TRITON_DISPATCH=1`` asks for
    it: the escape hatch should a Triton release change what :meth:`Variant.__call__` relies on (read
    once per process, :func:`k3tail.runtime.modes.env_flag`; the bits do not change, only the host time)."""
    return launch_hooks_installed() or env_flag(ENV_TRITON_DISPATCH)


def launch_hooks_installed() -> bool:
    """Is a Triton launch hook installed (a profiler such as proton)?  Then launches take Triton's own
    path, which calls it.  Triton 3.5+ keeps an (empty) ``HookChain`` in ``knobs.runtime`` at all times:
    only a chain with hooks in it counts (testing the attribute for None would send every launch
    through Triton's generic dispatcher)."""
    rt = _knobs.runtime if _knobs is not None else None
    return rt is not None and (_hook_active(rt.launch_enter_hook) or _hook_active(rt.launch_exit_hook))


class Variant:
    """One kernel with its compile-time values fixed: ``variant(grid, *runtime_args)`` launches it on
    the current stream (see the module docstring).  Build it with :meth:`Kernel.variant`."""

    def __init__(self, kernel: "Kernel", options: dict, constexprs: dict):
        self.kernel, self.options, self.constexprs = kernel, options, constexprs
        self._compiled: Dict[tuple, object] = {}
        self._tail: Optional[tuple] = None  # the constexpr values after the runtime args, in declared order
        self._nargs = -1
        self._layouts: Dict[tuple, tuple] = {}  # argument types -> positions of each kind (signature)
        self._lock = threading.Lock()

    def _tail_for(self, nargs: int) -> tuple:
        names = self.kernel.arg_names[nargs:]
        missing = [n for n in names if n not in self.constexprs and n not in self.kernel.defaults]
        if missing:
            raise ValueError(f"{self.kernel.name}: no value for {missing} (pass them as constexprs)")
        return tuple(self.constexprs[n] if n in self.constexprs else self.kernel.defaults[n] for n in names)

    def __call__(self, grid: Sequence[int], *args):
        k = self.kernel
        if _observer is not None:
            _observer(k.fn, tuple(grid), args, self.options, self.constexprs)
        if interpret_mode():
            return k.fn[tuple(grid)](*args, **self.constexprs, **self.options)
        if len(args) != self._nargs:
            self._tail, self._nargs = self._tail_for(len(args)), len(args)
        sig, argv = self.signature(args)
        c = self._compiled.get(sig)
        if c is None:
            c = self._compile(sig, grid, args)
        if warm_only_active():
            return None
        if generic_dispatch():
            return k.fn[tuple(grid)](*args, **self.constexprs, **self.options)
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = k.current_stream(k.current_device())
        c.run(g0, g1, g2, stream, c.function, c.packed_metadata, None, None, None, *argv, *self._tail)
        return None

    def signature(self, args: tuple) -> tuple:
        """``(key, argv)``: the key of the compiled kernel these runtime ``args`` select (two calls get
        the same key if and only if :func:`spec_key` of each argument and its type are the same, which
        is where Triton compiles a new variant), and the arguments as the launcher takes them (a CUDA
        tensor as its address, an int: Triton's launcher then skips its per-pointer driver query;
        host tensors such as pinned flags keep Triton's own translation).

        The host cost of a launch is mostly this (issue 30), so it is computed by position: the
        positions of each kind are fixed per tuple of argument types (:meth:`_layout`, cached), and
        each kind is read with C-level ``map`` / ``itemgetter`` instead of a per-argument branch."""
        types = tuple(map(type, args))
        lay = self._layouts.get(types)
        if lay is None:
            lay = self._layout(types)
        tget, tpos, tspec, iget, idns, oget, ospec, dget = lay
        key = [types]
        argv = args
        if tpos:
            tens = tget(args)
            ptrs = list(map(_DATA_PTR, tens))
            key.append(tuple(map(_DTYPE, tens)))
            key.append(tuple([tspec[j] and not p & 15 for j, p in enumerate(ptrs)]))
            argv = list(args)
            for i, p, on_gpu in zip(tpos, ptrs, map(_IS_CUDA, tens)):
                if on_gpu:
                    argv[i] = p
        if iget is not None:
            ints = iget(args)
            # _int_class, inlined once (a call per int would cost more than the rest of the key)
            cls = [0 if -2147483648 <= v <= 2147483647 else 2 if 9223372036854775808 <= v <= 18446744073709551615
                   else 1 for v in ints]
            key.append(tuple([c if dns else (c, v == 1, not v & 15) for v, c, dns in zip(ints, cls, idns)]))
        if dget is not None:  # host TMA descriptors: spec_key's (dtype, box), read inline (no call per one)
            key.append(tuple([(d.base.dtype, tuple(d.block_shape)) for d in dget(args)]))
        if oget is not None:
            key.append(tuple([spec_key(a, s) for a, s in zip(oget(args), ospec)]))
        return tuple(key), argv

    def _layout(self, types: tuple) -> tuple:
        """The positions of each kind of argument for one tuple of argument types: tensors (with
        whether each is specialized on its alignment), plain ints (whether each is
        ``do_not_specialize``), host TMA descriptors (keyed by :func:`spec_key`'s dtype and box, read
        inline: a large-M projection passes two per launch), and the rest that :func:`spec_key` reads
        per call (int subclasses, ...).  A bool, a float and None specialize on their type alone,
        which ``types`` holds."""
        dns = self.kernel.dns
        tpos = tuple(i for i, t in enumerate(types) if issubclass(t, torch.Tensor))
        ipos = tuple(i for i, t in enumerate(types) if t is int)
        dpos = tuple(i for i, t in enumerate(types) if _is_descriptor_type(t))
        opos = tuple(i for i, t in enumerate(types)
                     if i not in tpos and i not in ipos and i not in dpos and t not in (bool, float, type(None)))
        lay = (_getter(tpos) if tpos else None, tpos, tuple(i not in dns for i in tpos),
               _getter(ipos) if ipos else None, tuple(i in dns for i in ipos),
               _getter(opos) if opos else None, tuple(i not in dns for i in opos),
               _getter(dpos) if dpos else None)
        with self._lock:
            return self._layouts.setdefault(types, lay)

    def _compile(self, sig, grid, args):
        with self._lock:
            c = self._compiled.get(sig)
            if c is None:
                c = self.kernel.fn.warmup(*args, grid=tuple(grid), **self.constexprs, **self.options)
                c._init_handles()  # load the module now, never while a peer spins
                self._compiled[sig] = c
        return c


class Kernel:
    """The launcher of one ``@triton.jit`` kernel: its variants (one per set of compile-time values)."""

    def __init__(self, fn):
        self.fn = fn
        self.name = getattr(getattr(fn, "fn", fn), "__name__", repr(fn))
        self.arg_names = list(fn.arg_names)
        params = getattr(fn, "params", None)
        self.dns = frozenset(p.num for p in params if p.do_not_specialize) if params is not None else frozenset()
        sig = inspect.signature(getattr(fn, "fn", fn))
        self.defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
        self._variants: Dict[tuple, Variant] = {}
        self._lock = threading.Lock()
        self._stream_fn = None

    def variant(self, *, num_warps: int = 4, num_stages: Optional[int] = None, pdl: bool = False,
                **constexprs) -> Variant:
        key = (num_warps, num_stages, bool(pdl), tuple(sorted(constexprs.items())))
        v = self._variants.get(key)
        if v is None:
            opts = {"num_warps": num_warps}
            if num_stages is not None:
                opts["num_stages"] = num_stages
            if pdl and not interpret_mode():
                opts["launch_pdl"] = True  # a compile option as well as a launch attribute
            with self._lock:
                v = self._variants.setdefault(key, Variant(self, opts, dict(constexprs)))
        return v

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_stream(self, device: int):
        if self._stream_fn is None:
            from triton.runtime import driver
            self._stream_fn = driver.active.get_current_stream
        return self._stream_fn(device)


_kernels: Dict[int, Kernel] = {}
_kernels_lock = threading.Lock()


def kernel(fn) -> Kernel:
    """The one :class:`Kernel` of ``fn`` (created on first use)."""
    k = _kernels.get(id(fn))
    if k is None:
        with _kernels_lock:
            k = _kernels.setdefault(id(fn), Kernel(fn))
    return k


def launch(fn, grid, *args, pdl: bool = False, num_warps: int = 4, num_stages: Optional[int] = None,
           **constexprs):
    """One-off form of ``kernel(fn).variant(...)(grid, *args)`` (hot paths keep their Variant)."""
    return kernel(fn).variant(num_warps=num_warps, num_stages=num_stages, pdl=pdl, **constexprs)(grid, *args)


# ------------------------------------------------------------------ per-device launch facts
_pdl_cache: Dict[torch.device, bool] = {}
_sms_cache: Dict[torch.device, int] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, not the interpreter, not disabled."""
    if interpret_mode() or device.type != "cuda" or env_flag("K3TAIL_DISABLE_PDL"):
        return False
    v = _pdl_cache.get(device)
    if v is None:
        v = _pdl_cache[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return v


def sm_count(device: torch.device) -> int:
    n = _sms_cache.get(device)
    if n is None:
        n = _sms_cache[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def clock_arg(ws: Workspace) -> torch.Tensor:
    """The clock pointer argument: the clock page under the interpreter (else unused)."""
    return clock_page() if interpret_mode() else ws.ctrl


def grid_cap(group, device: torch.device, num_warps: int = 4) -> int:
    """Most programs one rank may launch so that the spinning grids of all ranks stay
    co-resident: one program per SM is resident whatever the kernel's registers and
    shared memory, so a rank gets ``SMs`` programs.  Kernels are persistent and loop over
    their work items, so a smaller grid only costs parallelism.

    Loopback (W virtual ranks on one GPU) has a second rule: a rank's spinning programs
    must leave room for the *other* ranks' ordinary kernels, which have to run for the
    spinners to finish.  With ``SMs // W`` programs per rank every SM held a spinner, and a
    GEMM whose thread blocks need a whole SM's shared memory (the projection at M > 16) had
    nowhere to go: seen on the H200 as whole-group timeouts of the gather after the GEMM
    (W=4 SEPARATE_REDUCE and W=8 FUSED_LANE_AR at M=64, eager and graphed).  So in loopback
    all spinners together take at most ``K3TAIL_LOOPBACK_SPIN_SHARE`` (default 0.5) of the
    SMs; the block scheduler spreads them, leaving the rest free of spinners."""
    if interpret_mode() or device.type != "cuda":
        return 1 << 30
    sms = sm_count(device)
    if isinstance(group, LoopbackGroup):
        share = float(os.environ.get("K3TAIL_LOOPBACK_SPIN_SHARE", "0.5"))
        if not 0.0 < share <= 1.0:
            raise ValueError(f"K3TAIL_LOOPBACK_SPIN_SHARE must be in (0, 1], got {share}")
        return max(1, int(sms * share) // group.world_size)
    return sms


def after_launch(ws: Workspace, op: str, timeout_s: float, detail: str = "") -> None:
    """Under the interpreter the launch has finished: raise the fault it met (a wait that timed
    out, another call's tag, an index out of range, a peer's fault record).  On a GPU the host
    learns it later, from the host mirror (the next call's ``ws.check``) or an op's ``check()``."""
    if interpret_mode() and ws.poisoned():
        raise ws.error(op, timeout_s, before=False, detail=detail)
