"""Where the host time of one eager ``K3MoETail`` call goes (issue 19): cProfile over many eager calls at
W = 1, K3 shape, enqueued behind a busy GPU (so the host never waits for the device).

    python bench/profile_host.py [--ms 1 1024 8192] [--calls 200] [--top 35] [--device cpu]

Prints, per M, the host time per call (the median over the calls, each timed alone), then the
split of it measured without a profiler: k3tail's own Python (the same calls with every kernel
launch stubbed out: ``Variant.__call__`` returns at once) and the launches (the rest:
``Variant.__call__`` with Triton's launcher and the driver), then the profile's top functions by
own time and by cumulative time.  A diagnostic, not a benchmark: cProfile's own overhead inflates
every Python frame (the figures printed first are measured without it).  ``--device cpu`` (no GPU;
the kernels would run in the interpreter) reports k3tail's own Python alone, then with each launch
prepared as on a GPU (Triton's launcher a no-op) and the number of Python function calls per eager
call (steady where timings on a shared CPU are not), for work on the host path without a device;
there the index check of the CPU tensors runs too, which a GPU call skips, and the projection takes
the GPU's tactics (the TMA tile and its two host descriptors at large M; no kernel runs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from k3tail.testing import no_multicast

no_multicast()  # before any GPU work (DESIGN §8)
import torch  # noqa: E402

from k3tail import testing as T  # noqa: E402
from k3tail.config import TailConfig  # noqa: E402
from k3tail.module import K3MoETail  # noqa: E402
from k3tail.ops import projection as P  # noqa: E402
from k3tail.runtime import launch as L  # noqa: E402

K3 = dict(hidden=7168, latent=3584, top_k=16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 1024, 8192])  # issue 30
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":  # the projection's tactics as on a GPU (the TMA tile at large M, its descriptors
        P.interpret_mode = lambda: False  # built per call), not the interpreter's pointer tiles; nothing
        P.G.tma_ok = lambda a, w: True  # runs on the CPU here (every launch is stubbed or a no-op)
    mod = K3MoETail(TailConfig(max_tokens=max(args.ms), **K3), prefix="bench.profile_host", device=dev)
    for M in args.ms:
        prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=1, rank=0, form="triple", seed=M, device=dev, **K3)
        ins = dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, graph_phase=False, **rt)
        for _ in range(5 if dev.type == "cuda" else 0):  # compile and load (CPU: the interpreter, nothing to warm)
            mod(**ins)
        own, launches = _without_launches(mod, ins, args.calls)
        if dev.type == "cpu":
            prep, ncalls = _launch_prep(mod, ins, args.calls)
            print(f"== M={M}: k3tail's own Python {own:.1f} us per eager call, launches stubbed ({launches} "
                  f"launches; {args.calls} calls, plan {mod.plan_for(M, False)}, projection "
                  f"{mod.context.project.tactic_for(M)['variant']}); with the launches prepared as "
                  f"on a GPU (signature, compiled-kernel lookup; Triton's launcher a no-op) {prep:.1f} us, "
                  f"{ncalls:.0f} Python calls per eager call")
            continue
        host = _timed(mod, ins, args.calls)
        _busy()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            mod(**ins)
        prof.disable()
        torch.cuda.synchronize()
        ncalls = pstats.Stats(prof).total_calls / args.calls  # steady where a shared host's timings are not
        print(f"== M={M}: host time {host:.1f} us per eager call ({args.calls} calls, plan {mod.plan_for(M, False)}, "
              f"{ncalls:.0f} Python calls per call)")
        print(f"   of which k3tail's own Python {own:.1f} us (launches stubbed) and {launches} launches "
              f"{host - own:.1f} us ({(host - own) / max(launches, 1):.1f} us each)")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            text = s.getvalue()
            print(text[text.index("ncalls"):] if "ncalls" in text else text)


def _busy():
    """GPU work ahead of the calls, so that they only enqueue (no wait for the device)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e9))


def _timed(mod, ins, calls: int, busy: bool = True) -> float:
    """Host time of one eager call in us: the median over ``calls`` calls, each timed alone (a shared VM
    host stalls now and then; a mean over the calls moved 2x between two runs of one commit on the same
    machine, the median does not take the stalls in).  ``busy``: enqueued behind a busy GPU, which calls
    that launch nothing do not need."""
    if busy:
        _busy()
    clock = time.perf_counter_ns
    times = []
    for _ in range(calls):
        t0 = clock()
        mod(**ins)
        times.append(clock() - t0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def _without_launches(mod, ins, calls: int):
    """``(host time per call in us, launches per call)`` with every launch stubbed out."""
    real = L.Variant.__call__
    n = [0]

    def stub(self, grid, *a):
        n[0] += 1

    L.Variant.__call__ = stub
    try:
        mod(**ins)
        n[0] = 0
        mod(**ins)
        per_call = n[0]
        dt = _timed(mod, ins, calls, busy=False)  # nothing is launched: no GPU work to wait behind
    finally:
        L.Variant.__call__ = real
    return dt, per_call


def _launch_prep(mod, ins, calls: int):
    """CPU only: ``(host time per call in us, Python function calls per call)`` with each launch prepared
    as on a GPU (``Variant.__call__`` out of interpreter mode: the signature, the compiled-kernel lookup)
    but Triton's launcher a no-op.  The call count (cProfile's) is the figure to compare on a noisy
    machine: it does not vary from run to run."""
    import types

    fake = types.SimpleNamespace(run=lambda *a: None, function=None, packed_metadata=None)
    saved = (L.interpret_mode, L.Variant._compile, L.Kernel.current_device, L.Kernel.current_stream)
    L.interpret_mode = lambda: False
    L.Variant._compile = lambda self, sig, grid, args: self._compiled.setdefault(sig, fake)
    L.Kernel.current_device = lambda self: 0
    L.Kernel.current_stream = lambda self, device: 0
    compiled = {id(v): dict(v._compiled) for k in L._kernels.values() for v in k._variants.values()}
    try:
        mod(**ins)
        dt = _timed(mod, ins, calls, busy=False)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            mod(**ins)
        prof.disable()
        ncalls = pstats.Stats(prof).total_calls / calls
    finally:
        L.interpret_mode, L.Variant._compile, L.Kernel.current_device, L.Kernel.current_stream = saved
        for k in L._kernels.values():  # forget the fake compiled kernels
            for v in k._variants.values():
                v._compiled = compiled.get(id(v), {})
    return dt, ncalls


if __name__ == "__main__":
    main()
