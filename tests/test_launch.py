"""``_launch.grid_cap``: the co-residency rule for spinning grids (loopback leaves SMs free)."""

import types

import pytest
import torch

from k3tail.runtime import launch as L
from k3tail.runtime.loopback import LoopbackGroup


class _FakeWorld:
    def __init__(self, w):
        self.world_size = w


@pytest.fixture
def gpu_props(monkeypatch):
    monkeypatch.setattr(L, "interpret_mode", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=132))
    return torch.device("cuda", 0)


@pytest.mark.parametrize("W,expected", [(1, 66), (2, 33), (4, 16), (8, 8), (200, 1)])
def test_loopback_spinners_take_half_the_sms(gpu_props, monkeypatch, W, expected):
    monkeypatch.delenv("K3TAIL_LOOPBACK_SPIN_SHARE", raising=False)
    group = LoopbackGroup(_FakeWorld(W), 0)
    cap = L.grid_cap(group, gpu_props)
    assert cap == expected
    assert cap * W <= 132 // 2 or cap == 1  # all ranks' spinners together leave half the SMs free


def test_loopback_share_env(gpu_props, monkeypatch):
    group = LoopbackGroup(_FakeWorld(4), 0)
    monkeypatch.setenv("K3TAIL_LOOPBACK_SPIN_SHARE", "1.0")
    assert L.grid_cap(group, gpu_props) == 33
    monkeypatch.setenv("K3TAIL_LOOPBACK_SPIN_SHARE", "0")
    with pytest.raises(ValueError, match="K3TAIL_LOOPBACK_SPIN_SHARE"):
        L.grid_cap(group, gpu_props)


def test_process_groups_get_every_sm(gpu_props):
    assert L.grid_cap(None, gpu_props) == 132


def test_cpu_and_interpreter_are_uncapped(monkeypatch):
    assert L.grid_cap(None, torch.device("cpu")) == 1 << 30


def test_loopback_run_forks_both_passes(monkeypatch):
    """Both passes of LoopbackWorld.run (the warm pass runs fn's torch ops for real) wait for the
    current stream before fn and are joined back: without it the warm pass read inputs the
    current stream was still writing (H200: a gather asserted on a half-written expanded_idx)."""
    import contextlib

    from k3tail.runtime.modes import warm_only_active
    from k3tail.runtime.loopback import LoopbackWorld

    log = []

    class S:
        def __init__(self, name):
            self.name, self.cuda_stream = name, hash(name)

        def wait_stream(self, other):
            log.append(f"{self.name}<-{other.name}")

    cur = S("cur")
    world = object.__new__(LoopbackWorld)
    world.world_size, world.device, world.streams = 2, torch.device("cuda", 0), [S("s0"), S("s1")]
    active = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: active[-1] if active else cur)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    @contextlib.contextmanager
    def stream(s):
        active.append(s)
        try:
            yield
        finally:
            active.pop()
    monkeypatch.setattr(torch.cuda, "stream", stream)

    def fn(r):
        mode = "warm" if warm_only_active() else "real"
        log.append(f"{mode} fn{r} on {torch.cuda.current_stream().name}")
        return r

    assert world.run(fn) == [0, 1]
    one_pass = ["s0<-cur", "{m} fn0 on s0", "s1<-cur", "{m} fn1 on s1", "cur<-s0", "cur<-s1"]
    assert log == [x.format(m="warm") for x in one_pass] + [x.format(m="real") for x in one_pass]
    log.clear()
    world.run(fn, warm=False)
    assert log == [x.format(m="real") for x in one_pass]
    active.append(world.streams[1])  # the current stream is a rank stream: refused
    from k3tail.errors import K3TailError
    with pytest.raises(K3TailError, match="current stream is one of the virtual ranks"):
        world.run(fn)


def _fake_stream_pool(monkeypatch, dev):
    """torch.cuda.Stream / current_stream faked (no GPU here): a new stream's handle is the next of
    ``pool[0]`` (set it to an iterator of handles), the current stream's is 7; returns (pool, S)."""
    pool = [iter(())]

    class S:
        def __init__(self, device=None, handle=None):
            self.device = dev
            self.cuda_stream = next(pool[0]) if handle is None else handle

    monkeypatch.setattr(torch.cuda, "Stream", S)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: S(handle=7))
    return pool, S


def test_rank_streams_skip_current_and_capture_stream(monkeypatch):
    """torch's stream pool wraps after 32: rank streams must never be the current stream or
    torch.cuda.graph's default capture stream (a rank would then serialize the others)."""
    from k3tail.errors import K3TailError
    from k3tail.runtime.loopback import rank_streams

    dev = torch.device("cuda", 0)
    pool, S = _fake_stream_pool(monkeypatch, dev)
    pool[0] = iter([5, 7, 5, 9, 11, 13] + list(range(100, 200)))
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", S(handle=9), raising=False)
    got = [s.cuda_stream for s in rank_streams(dev, 4)]
    assert got == [5, 11, 13, 100]  # 7 (current), the second 5 (taken) and 9 (capture) skipped
    pool[0] = iter([1, 1] * 100)
    with pytest.raises(K3TailError, match="too few distinct streams"):
        rank_streams(dev, 3)


def test_capture_stream_is_never_a_rank_stream(monkeypatch):
    """``LoopbackWorld.capture_stream``: one stream, the same every call, that is neither a rank's stream
    nor the current one, even when torch's pool hands those out again; none left: a clear error."""
    from k3tail.errors import K3TailError
    from k3tail.runtime.loopback import LoopbackWorld

    dev = torch.device("cuda", 0)
    pool, S = _fake_stream_pool(monkeypatch, dev)
    world = object.__new__(LoopbackWorld)  # no GPU here: the fields capture_stream reads
    world.device, world.streams, world._capture = dev, [S(handle=h) for h in (3, 4, 5)], None
    pool[0] = iter([4, 7, 3, 5, 6, 8])
    first = world.capture_stream()
    assert first.cuda_stream == 6 and world.capture_stream() is first
    world._capture, pool[0] = None, iter([3, 4, 5, 7] * 20)
    with pytest.raises(K3TailError, match="no stream left"):
        world.capture_stream()


def test_loopback_run_issues_every_rank_when_one_raises(monkeypatch):
    """``LoopbackWorld.run``: a rank whose call raises does not keep the ranks after it from making
    theirs (separate processes would each call); every stream is joined back; the first rank's error
    is raised and ``last_errors`` holds each rank's."""
    import contextlib

    from k3tail.runtime.loopback import LoopbackWorld

    dev = torch.device("cuda", 0)
    _, S = _fake_stream_pool(monkeypatch, dev)
    joined = []
    S.wait_stream = lambda self, other: joined.append((self.cuda_stream, other.cuda_stream))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    world = object.__new__(LoopbackWorld)
    world.device, world.streams, world._capture = dev, [S(handle=h) for h in (3, 4, 5, 6)], None
    called = []

    def fn(r):
        called.append(r)
        if r in (1, 2):
            raise ValueError(f"rank {r} fails")
        return r * 10

    with pytest.raises(ValueError, match="rank 1 fails"):
        world.run(fn, warm=False)
    assert called == [0, 1, 2, 3]
    assert [type(e).__name__ if e else None for e in world.last_errors] == [None, "ValueError", "ValueError", None]
    assert sorted(j for j in joined if j[0] == 7) == [(7, 3), (7, 4), (7, 5), (7, 6)]  # every rank joined back
    assert world.run(lambda r: r + 1, warm=False) == [1, 2, 3, 4] and world.last_errors == [None] * 4
    # the raised error's traceback (the run's frame) does not keep the other ranks' outputs alive
    import weakref
    refs = []

    def fn2(r):
        t = torch.ones(4)
        refs.append(weakref.ref(t))
        if r == 2:
            raise ValueError("rank 2 fails")
        return t

    import gc
    gc.disable()  # what follows must hold by reference counting alone: no cycle may keep a failed call alive
    try:
        with pytest.raises(ValueError) as info:
            world.run(fn2, warm=False)
        assert info.value is world.last_errors[2]
        world.last_errors = None
        assert [ref() is None for i, ref in enumerate(refs) if i != 2] == [True] * 3
        # ... nor, once the caller drops the error, the failing rank's own tensors (its frame is in the
        # traceback): error -> traceback -> run's frame -> a local naming the error would be a cycle
        assert refs[2]() is not None
        del info
        assert refs[2]() is None, "a reference cycle keeps the failed call's tensors until a full gc"
    finally:
        gc.enable()


# ------------------------------------------------------------------ the direct launcher
def _native_spec():
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # pragma: no cover - every supported Triton has it
        pytest.skip("this Triton has no native_specialize_impl")
    return lambda arg, spec: native_specialize_impl(BaseBackend, arg, False, spec, True)


def test_spec_key_mirrors_tritons_specialization():
    """``spec_key`` must split arguments exactly where Triton compiles a new variant: two arguments
    get the same key if and only if Triton's own specialization of them is the same (else a launch
    would run a variant compiled for another alignment or integer class)."""
    native = _native_spec()
    buf = torch.zeros(64, dtype=torch.bfloat16)
    args = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 40, 2 ** 63, 2 ** 63 + 16,
            -(2 ** 31), -(2 ** 31) - 1, True, False, 1.5, 0.0, None,
            buf, buf[1:], buf[8:], buf.float(), buf.float()[1:], buf.float()[4:], buf.to(torch.int32)]
    for spec in (True, False):
        for a in args:
            for b in args:
                same_native = native(a, spec) == native(b, spec) and type(a) is type(b)
                same_ours = L.spec_key(a, spec) == L.spec_key(b, spec) and type(a) is type(b)
                def show(x):
                    return (x.dtype, x.data_ptr() % 16) if isinstance(x, torch.Tensor) else x
                assert same_native == same_ours, (show(a), show(b), spec, native(a, spec), native(b, spec))


def test_variant_signature_splits_where_spec_key_does():
    """``Variant.signature`` (by position, at C speed: issue 30) must give two argument tuples the same
    key if and only if their types and :func:`spec_key` of each argument are the same, with the kernel's
    ``do_not_specialize`` arguments (here an int and a pointer) keeping only what Triton keeps of them.
    Its launcher arguments are the arguments themselves (CPU tensors stay tensors)."""
    import itertools
    import random

    import numpy as np
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_ns", "p_ns"])
    def k(p, n, n_ns, p_ns, x, B: tl.constexpr):
        pass

    kern = L.Kernel(k)
    if not kern.dns:  # the interpreter's function keeps no do_not_specialize: set what Triton's would
        kern.dns = frozenset({2, 3})
    dns = kern.dns
    assert dns == {2, 3}
    v = kern.variant(B=4)
    buf = torch.zeros(64, dtype=torch.bfloat16)
    tens = [buf, buf[1:], buf[8:], buf.float(), buf.float()[4:], torch.nn.Parameter(buf.float(), requires_grad=False)]
    ints = [0, 1, 2, 16, 17, -16, 2 ** 31 - 1, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 63 + 16, -(2 ** 31) - 1,
            np.int64(16)]
    other = [True, False, 1.5, 0.0, np.float64(2.0), None]
    # host TMA descriptors (their own path in the signature: dtype and box, read inline), from Triton's
    # dataclass and from gemm.host_descriptor (the projection's), which must key alike
    from triton.tools.tensor_descriptor import TensorDescriptor

    from k3tail.triton_kernels.gemm import host_descriptor

    fast = host_descriptor()
    descs = [mk(b, [64], [1], [blk]) for mk in (TensorDescriptor, fast) for b in (buf, buf.float())
             for blk in (16, 32)]
    pool = [tens + ints[:3] + [None], ints + [1.5, True], ints, tens + [None], tens + ints + other + descs]
    rng = random.Random(1234)
    combos = [tuple(rng.choice(p) for p in pool) for _ in range(400)]
    combos += [(buf, 16, 3, buf, x) for x in ints + other + tens + descs]  # one position through every kind

    def slow(args):
        return tuple((type(a), L.spec_key(a, i not in dns)) for i, a in enumerate(args))

    keys = {}
    for args in combos:
        key, argv = v.signature(args)
        assert len(argv) == len(args) and all(x is a for x, a in zip(argv, args))
        keys.setdefault(key, set()).add(slow(args))
    assert all(len(s) == 1 for s in keys.values()), "one key, several Triton specializations"
    by_slow = {}
    for key, s in keys.items():
        by_slow.setdefault(next(iter(s)), set()).add(key)
    assert all(len(s) == 1 for s in by_slow.values()), "one Triton specialization, several keys"
    assert len(keys) > 100
    for a, b in itertools.combinations([(buf, 16, 3, buf[1:], 0), (buf, 16, 3, buf[8:], 0)], 2):
        assert v.signature(a)[0] == v.signature(b)[0]  # p_ns: its alignment does not split


def test_variant_fills_constexprs_in_declared_order(monkeypatch):
    """A Variant passes the runtime arguments then the constexprs in the kernel's declared order (what
    ``CompiledKernel.run`` takes), and refuses a launch that leaves a constexpr without a value."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 3):
        pass

    kern = L.Kernel(k)
    v = kern.variant(A=7)
    assert v._tail_for(2) == (7, 3)
    with pytest.raises(ValueError, match="no value"):
        kern.variant()._tail_for(2)
    assert kern.variant(A=7) is v  # one Variant per set of compile-time values


def test_launch_hooks_detected_only_when_installed():
    """With no profiler, launches take the direct path: Triton 3.5+ keeps an empty ``HookChain`` in
    ``knobs.runtime`` at all times, which is no hook (a None test sent every launch through Triton's
    generic dispatcher, issue 19); a hook added to the chain (or set, before 3.5) is one."""
    from triton import knobs

    rt = knobs.runtime
    assert not L.launch_hooks_installed(), (rt.launch_enter_hook, rt.launch_exit_hook)

    def hook(metadata):
        pass

    chain = rt.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert L.launch_hooks_installed()
        finally:
            chain.remove(hook)
    else:  # pragma: no cover - Triton < 3.5
        rt.launch_enter_hook = hook
        try:
            assert L.launch_hooks_installed()
        finally:
            rt.launch_enter_hook = chain
    assert not L.launch_hooks_installed()


def test_triton_dispatch_switch(monkeypatch):
    """``K3TAIL_TRITON_DISPATCH=1`` sends launches through Triton's dispatcher; unset or 0, the direct path.
    The switch is read once per process (``modes.env_flag``): a change takes effect after ``reread_env``."""
    from k3tail.runtime import modes

    monkeypatch.setattr(modes, "_flags", {})
    monkeypatch.delenv(L.ENV_TRITON_DISPATCH, raising=False)
    assert not L.generic_dispatch()
    monkeypatch.setenv(L.ENV_TRITON_DISPATCH, "1")
    assert not L.generic_dispatch()  # read once: the change is not seen ...
    modes.reread_env()
    assert L.generic_dispatch()  # ... until the switches are read again
    monkeypatch.setenv(L.ENV_TRITON_DISPATCH, "0")
    modes.reread_env()
    assert not L.generic_dispatch()


@pytest.mark.gpu
def test_variant_launch_equals_tritons_launch():
    """On the GPU a Variant launches the compiled kernel directly: the same results as Triton's own
    launch, a new variant where the specialization changes (a misaligned view), warm-only compiles."""
    import triton
    import triton.language as tl

    from k3tail.runtime.modes import warm_only

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, a * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    v = L.kernel(axpy).variant(BLOCK=256)
    generic = []  # Triton's own dispatch, outside warmup: must not be where a Variant launches
    run = axpy.run

    def counting_run(*a, warmup=False, **kw):
        if not warmup:
            generic.append(1)
        return run(*a, warmup=warmup, **kw)

    for xs, ys, n in ((x, y, 1000), (x[1:], y[1:], 999), (x[16:], y[:984], 984), (x, y, 1)):
        ours = torch.full_like(xs, float("nan"))
        ref = torch.full_like(xs, float("nan"))
        axpy.run = counting_run
        try:
            with warm_only():
                v((triton.cdiv(n, 256),), xs, ys, ours, n, 2.5)
            assert torch.isnan(ours).all()  # compiled and loaded, not launched
            v((triton.cdiv(n, 256),), xs, ys, ours, n, 2.5)
        finally:
            axpy.run = run
        assert not generic, "the Variant launched through Triton's generic dispatcher"
        axpy[(triton.cdiv(n, 256),)](xs, ys, ref, n, 2.5, BLOCK=256)
        torch.cuda.synchronize()
        assert torch.equal(ours[:n], ref[:n]), n
    assert len(v._compiled) >= 3  # aligned, misaligned, n == 1 (specialized) are different variants
