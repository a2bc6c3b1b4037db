"""The interpreter's clock page advances, and a process that used it exits cleanly (a daemon
thread inside a torch op at teardown once aborted the process with exit code 134)."""

import subprocess
import sys
import time


def test_clock_page_advances():
    from k3tail.runtime.clock import clock_page

    page = clock_page()
    a = int(page[0])
    time.sleep(0.05)
    b = int(page[0])
    assert b - a >= 20_000_000, (a, b)  # >= 20 ms of the 50 ms slept
    assert abs(b - time.monotonic_ns()) < 50_000_000


def test_process_using_the_clock_exits_cleanly():
    code = "import time, k3tail.runtime.clock as c; c.clock_page(); time.sleep(0.05)"
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stderr[-500:])
        assert "terminate called" not in r.stderr


def test_forked_child_clock_advances():
    """A child forked after the page started gets its own refreshing thread (a frozen page would let
    a wait for an absent peer spin past its deadline forever)."""
    import multiprocessing as mp

    from k3tail.runtime.clock import clock_page

    clock_page()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads_clock, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    a, b = q.get(timeout=5)
    assert b - a >= 20_000_000, f"the child's clock page moved {b - a} ns in 50 ms"


def _child_reads_clock(q):
    import time

    from k3tail.runtime.clock import clock_page

    page = clock_page()
    a = int(page[0])
    time.sleep(0.05)
    q.put((a, int(page[0])))
