"""Where the host time of one eager ``K3MoETail`` call goes (issue 19): cProfile over many eager calls at
W = 1, K3 shape, enqueued behind a busy GPU (so the host never waits for the device).

    python bench/profile_host.py [--ms 1 1024 8192] [--calls 200] [--top 35]

Prints, per M, the host time per call and the profile's top functions by own time and by cumulative
time.  A diagnostic, not a benchmark: cProfile's own overhead inflates every Python frame (the
per-call figure printed first is measured without it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from k3tail.testing import no_multicast

no_multicast()  # before any GPU work (DESIGN §8)
import torch  # noqa: E402

from k3tail import testing as T  # noqa: E402
from k3tail.config import TailConfig  # noqa: E402
from k3tail.module import K3MoETail  # noqa: E402

K3 = dict(hidden=7168, latent=3584, top_k=16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 1024, 8192])  # issue 30
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    dev = torch.device("cuda")
    mod = K3MoETail(TailConfig(max_tokens=max(args.ms), **K3), prefix="bench.profile_host", device=dev)
    for M in args.ms:
        prefix, gamma, up, shared, rt = T.tail_inputs(M=M, W=1, rank=0, form="triple", seed=M, device=dev, **K3)
        ins = dict(prefix_hidden=prefix, shared=shared, norm_weight=gamma, up_weight=up, graph_phase=False, **rt)
        for _ in range(5):
            mod(**ins)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e9))  # GPU work ahead of the calls: they only enqueue
        t0 = time.perf_counter()
        for _ in range(args.calls):
            mod(**ins)
        host = (time.perf_counter() - t0) / args.calls * 1e6
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e9))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            mod(**ins)
        prof.disable()
        torch.cuda.synchronize()
        print(f"== M={M}: host time {host:.1f} us per eager call ({args.calls} calls, plan {mod.plan_for(M, False)})")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
            text = s.getvalue()
            print(text[text.index("ncalls"):] if "ncalls" in text else text)


if __name__ == "__main__":
    main()
