"""Every host-side wait ends by a deadline (issue 32): construction, ``k3tail.reset`` and the recovery,
not only the calls.

The defect: at W = 2, rank 1 skips one call of a layer (same M).  Its next call pairs with rank 0's
current one (calls pair by order, as NCCL's do: unavoidable), so rank 0's next call has no partner and
times out.  Rank 1 saw no fault, builds new modules and used to wait in a gloo collective of the
construction (the P2P probe's workspace, the vote, the tactics) that rank 0, recovering, never joined:
a hang.  Now every host rendezvous goes through ``Comm.exchange`` (``k3tail.runtime.comm``): through
the store, bounded by ``timeout_s + SLACK_S``, with one decision that every rank follows, carrying each
rank's fault state (a rank that saw a fault makes every rank recover before the vote).

CPU rank processes (``k3tail.spawn``: gloo + the interpreter), W = 2 and 3, one gloo group per scenario
(a rank that gives up on one group goes on with the next), in each tier mode: the Lamport lane
(FUSED_LANE_AR, M = 3), the graph-phase tail (TAIL_FUSION, ``graph_phase=True``) and SEPARATE_REDUCE
over the gloo group (the call header):

* ``skip``: one rank skips call 1; its call 2 pairs with its peers' call 1 (by order) and the peers'
  call 2 times out; then every rank builds new modules (the same prefix at W = 2, a new one at W = 3)
  or runs ``k3tail.reset``: every rank recovers together and the new modules are exact;
* ``raise``: one rank raises an exception of its own at call 1 and never calls again on that group; its
  peers call on (PeerTimeout, then WorkspacePoisoned) and build new modules (with ``timeout_s = 1 s``:
  the new module's own bound; at W = 2 in the lane mode also ``k3tail.reset(group, timeout_s=1)``):
  every peer raises PeerTimeout naming the phase, the absent rank and the layer.

In every case every operation of every rank returns or raises within ``timeout_s + 5 s`` (measured per
rank and operation) and the rank processes end.  A rank's watchdog turns an operation that runs past
``timeout_s + 15 s`` into an exit with a note, which the test reports as an assertion (a hang cannot
run into pytest's own timeout).  No blocking ``torch.distributed`` collective runs while a rank builds
or resets (each is wrapped and recorded: only ``Comm``'s bounded rendezvous may wait).  The prologue
at W = 3 checks ``Comm.exchange`` itself: a rank that arrives after the deadline, a rank that fails
between two rendezvous, ranks at different rendezvous.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time

import torch

import k3tail
from k3tail import testing as T
from k3tail.runtime.spawn import SpawnError
from k3tail.tiers import Tier
from tests import test_pairing as P

TIMEOUT = 2.0
BOUND = TIMEOUT + 5.0  # what every operation of every rank must stay within
HANG = TIMEOUT + 15.0  # the watchdog's verdict: this operation hangs
RAISE_BUILD_TIMEOUT = 1.0  # the timeout_s of the module the peers build after a rank gave up
M = 3
MODES = {"lane": (Tier.FUSED_LANE_AR, False), "tail": (None, True), "separate": (Tier.SEPARATE_REDUCE, False)}


# ------------------------------------------------------------------------------ rank side
class _Watchdog:
    """Exits the rank process (code 17) with a note in ``notes/hang-rank<r>.txt`` when one operation
    runs past HANG seconds: the parent turns it into an assertion that names the operation."""

    def __init__(self, rank, notes):
        self.rank, self.notes, self.op, self.t0 = rank, notes, None, 0.0
        threading.Thread(target=self._run, daemon=True).start()

    def arm(self, op):
        self.op, self.t0 = op, time.monotonic()

    def disarm(self):
        self.op = None

    def _run(self):
        while True:
            time.sleep(0.5)
            op = self.op
            if op is not None and time.monotonic() - self.t0 > HANG:
                path = os.path.join(self.notes, f"hang-rank{self.rank}.txt")
                with open(path, "w") as f:
                    f.write(f"rank {self.rank}: {op} still running after {time.monotonic() - self.t0:.1f} s\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f)
                os._exit(17)


# torch.distributed's collectives: none may run during a construction, a reset or a recovery (a rank
# that never joins one would leave its peers waiting without a deadline); Comm.exchange replaces them
_COLLECTIVES = ("barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
                "scatter_object_list", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                "reduce", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                "all_to_all_single")
_GUARD = {"op": None, "seen": []}


def _guard_collectives():
    """Wrap torch.distributed's collectives: while a host-side operation of k3tail runs (``_op`` names
    it build*/reset*), record every blocking collective entered (the call still runs).  An async one
    (``async_op=True``) is allowed: its wait carries a timeout (the recovery joins the group headers
    its peers wait in that way, ``module._recover``)."""
    import torch.distributed as dist

    def wrap(name, fn):
        def guarded(*a, **k):
            op = _GUARD["op"]
            if op is not None and op.startswith(("build", "reset")) and not k.get("async_op"):
                _GUARD["seen"].append(f"{op}: torch.distributed.{name}")
            return fn(*a, **k)
        return guarded
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _op(log, dog, name, fn):
    """Run ``fn()``, log ``{op, ok, t, ...}`` (the error's class, message, phase, failing rank, layer)."""
    dog.arm(name)
    _GUARD["op"] = name
    t0 = time.monotonic()
    try:
        v = fn()
        log.append({"op": name, "ok": True, "t": time.monotonic() - t0})
        return v
    except Exception as e:  # noqa: BLE001 - recorded for the parent's assertions
        log.append({"op": name, "ok": False, "t": time.monotonic() - t0, "cls": type(e).__name__,
                    "msg": str(e)[:800], "phase": getattr(e, "phase", None), "layer": getattr(e, "layer", None),
                    "failing": getattr(e, "failing_rank", None), "k3": isinstance(e, k3tail.K3TailError)})
        return None
    finally:
        dog.disarm()
        _GUARD["op"] = None


def _build(pg, prefix, timeout_s=TIMEOUT):
    cfg = k3tail.TailConfig(max_tokens=16, **P.SHAPE)
    return k3tail.K3MoETail(cfg, pg, prefix=prefix, lane_max_tokens=P.LANE, timeout_s=timeout_s, tactics={})


def _call(mod, mode, rank, W, seed):
    forced, gp = MODES[mode]
    y = mod(graph_phase=gp, tier=forced, **P._inputs(P.SHAPE, M, W, rank, seed))
    return y


def _scenario(rank, W, sc, pg, dog):
    log, outs = [], {}
    mode, v, base = sc["mode"], sc["victim"], 100 * sc["id"]
    prefix = f"dl{sc['id']}.layers.0"
    mod = _op(log, dog, "build0", lambda: _build(pg, prefix))
    if mod is None:
        return {"log": log, "outs": outs}
    outs[0] = _op(log, dog, "call0", lambda: _call(mod, mode, rank, W, base))
    if sc["fault"] == "raise":
        if rank == v:
            def own():
                raise RuntimeError("the engine's own error on this rank")
            _op(log, dog, "own", own)
            return {"log": log, "outs": outs}  # never calls again on this group
        for i in (1, 2):
            _op(log, dog, f"call{i}", lambda: _call(mod, mode, rank, W, base + i))
        # (the new module's own timeout_s bounds its construction: a shorter one here)
        _op(log, dog, "build1", lambda: _build(pg, f"dl{sc['id']}.layers.1", timeout_s=RAISE_BUILD_TIMEOUT))
        if sc.get("reset"):  # (an explicit timeout_s: the reset's own bound, not the modules')
            _op(log, dog, "reset", lambda: k3tail.reset(pg, timeout_s=1.0))
        return {"log": log, "outs": outs}
    for i in (1, 2):  # skip: the victim stays away from call 1 (and makes call 2, which pairs with call 1)
        if not (rank == v and i == 1):
            outs[i] = _op(log, dog, f"call{i}", lambda: _call(mod, mode, rank, W, base + i))
    if sc["recover"] == "reset":
        _op(log, dog, "reset", lambda: k3tail.reset(pg))
        new = mod
    else:
        name = prefix if sc["recover"] == "same" else f"dl{sc['id']}.layers.1"
        new = _op(log, dog, "build1", lambda: _build(pg, name))
    if new is not None:
        outs[3] = _op(log, dog, "call3", lambda: _call(new, mode, rank, W, base + 3))
    return {"log": log, "outs": outs}


def _prologue(rank, W, pg, dog):
    """``Comm.exchange`` on its own (a deadline of 1 s, no slack): late, failed and mismatched ranks."""
    from k3tail.runtime.comm import comm_for, host_deadline

    c = comm_for(pg)
    log = []

    def rdv(fn, late=0.0, timeout=1.0):
        def body():
            time.sleep(late)
            with host_deadline(c, timeout, what="prologue", layer="dl.prologue", slack_s=0.0):
                return fn()
        return body

    _op(log, dog, "late", rdv(c.barrier, late=2.0 if rank == W - 1 else 0.0))  # the last rank comes late
    got = _op(log, dog, "after_late", rdv(lambda: c.broadcast_object(f"from {rank}", src=1), timeout=5.0))

    def fail_then_barrier():
        if rank == 1:
            raise ValueError("rank 1's own error between two rendezvous")
        c.barrier()
    _op(log, dog, "abandoned", rdv(fail_then_barrier))
    _op(log, dog, "mismatch", rdv(c.barrier if rank == 0 else (lambda: c.all_reduce_min([rank]))))
    mins = _op(log, dog, "after_all", rdv(lambda: c.all_reduce_min([rank + 5, -rank]), timeout=5.0))
    return {"log": log, "got": got, "mins": mins}


def _worker(rank, W, scenarios, notes, prologue):
    import torch.distributed as dist

    dog = _Watchdog(rank, notes)
    groups = [dist.new_group(list(range(W)), backend="gloo") for _ in range(len(scenarios) + 1)]
    _guard_collectives()
    out = {"scenarios": [], "collectives": _GUARD["seen"]}
    if prologue:
        out["prologue"] = _prologue(rank, W, groups[-1], dog)
    for sc, pg in zip(scenarios, groups):
        dist.barrier()  # (the harness's own, on the default group: the scenarios start together)
        t0 = time.monotonic()
        res = _scenario(rank, W, sc, pg, dog)
        res["wall"] = time.monotonic() - t0
        out["scenarios"].append(res)
    dist.barrier()  # (the harness's: a rank that gave up on a group stays alive until its peers are done)
    return out


# ------------------------------------------------------------------------------ parent side
def _run(W, scenarios, tmp_path, budget_s, prologue=False):
    t0 = time.monotonic()
    try:
        res = k3tail.spawn(W, _worker, scenarios, str(tmp_path), prologue, timeout=budget_s)
    except SpawnError as e:
        notes = "".join(open(os.path.join(tmp_path, f)).read()[:3000] for f in sorted(os.listdir(tmp_path))
                        if f.startswith("hang-"))
        raise AssertionError(f"W={W}: the rank processes did not all end with a result within {budget_s} s "
                             f"(a hang, or a rank that died): {str(e)[:3000]}\n{notes}") from None
    took = time.monotonic() - t0
    print(f"\nW={W}: {len(scenarios)} scenarios in {took:.1f} s")
    return res


def _fmt(e):
    return (f"{e['op']}: ok {e['t']:.1f} s" if e["ok"] else
            f"{e['op']}: {e['cls']} {e['t']:.1f} s [{e['msg'][:300]}]")


def _check(res, W, scenarios):
    fails = []
    for r in range(W):  # every host wait of construction, reset and recovery is one of Comm's bounded rendezvous
        if res[r]["collectives"]:
            fails.append(f"rank {r} entered torch.distributed collectives (no deadline) while building or "
                         f"resetting: {sorted(set(res[r]['collectives']))}")
    for si, sc in enumerate(scenarios):
        what = f"W={W} {sc['mode']} {sc['fault']} (victim {sc['victim']}, {sc.get('recover', '')})"
        rows = [res[r]["scenarios"][si] for r in range(W)]
        logs = [{e["op"]: e for e in row["log"]} for row in rows]
        print(f"  {what}: " + " | ".join(f"rank {r}: " + ", ".join(_fmt(e) for e in rows[r]["log"])
                                         for r in range(W)))

        def fail(msg):
            fails.append(f"{what}: {msg}")
        for r in range(W):
            for e in rows[r]["log"]:
                if e["t"] > BOUND:
                    fail(f"rank {r} {e['op']} took {e['t']:.1f} s > timeout_s + 5 = {BOUND} s ({_fmt(e)})")
                if not e["ok"] and not e["k3"] and e["op"] != "own":
                    fail(f"rank {r} {e['op']} raised a non-k3tail error: {_fmt(e)}")
            if not logs[r].get("build0", {}).get("ok") or not logs[r].get("call0", {}).get("ok"):
                fail(f"rank {r}: the healthy start failed: {[_fmt(e) for e in rows[r]['log'][:2]]}")
        v, peers = sc["victim"], [r for r in range(W) if r != sc["victim"]]
        if sc["fault"] == "skip":
            if not logs[v]["call2"]["ok"]:
                fail(f"the victim's call 2 (paired with its peers' call 1, by order) raised: {_fmt(logs[v]['call2'])}")
            for r in peers:
                if not logs[r]["call1"]["ok"]:
                    fail(f"rank {r}'s call 1 (paired with the victim's call 2) raised: {_fmt(logs[r]['call1'])}")
                c2 = logs[r]["call2"]
                if c2["ok"] or c2["cls"] not in ("PeerTimeout", "PeerFault", "PeerMismatch"):
                    fail(f"rank {r}'s call 2 (the first unmatched call) did not raise a PeerFault: {_fmt(c2)}")
            rec = "reset" if sc["recover"] == "reset" else "build1"
            for r in range(W):  # every rank recovers together: the new modules are exact, alike on every rank
                if not logs[r][rec]["ok"] or not logs[r]["call3"]["ok"]:
                    fail(f"rank {r}: {rec} / call 3 after the recovery failed: "
                         f"{[_fmt(e) for e in rows[r]['log'] if e['op'] in (rec, 'call3')]}")
            ys = [rows[r]["outs"].get(3) for r in range(W)]
            if all(y is not None for y in ys):
                ref = P._reference(P.SHAPE, M, W, 100 * sc["id"] + 3)
                try:
                    T.check_tail(ys[0], what=f"{what} call 3", **ref)
                except AssertionError as e:
                    fail(f"call 3 after the recovery is wrong: {e}")
                for r in range(1, W):
                    if not torch.equal(ys[r].view(torch.int16), ys[0].view(torch.int16)):
                        fail(f"call 3: rank {r}'s output differs from rank 0's")
        else:
            if logs[v]["own"]["ok"]:
                fail("the victim's own error was not raised")
            for r in peers:
                c1 = logs[r]["call1"]
                if c1["ok"] or c1["cls"] != "PeerTimeout":
                    fail(f"rank {r}'s call 1 did not raise PeerTimeout: {_fmt(c1)}")
                for op, phase in (("build1", "construction"), ("reset", "k3tail.reset")):
                    e = logs[r].get(op)
                    if e is None:
                        continue
                    if e["t"] > RAISE_BUILD_TIMEOUT + 5.0:  # both with timeout_s = 1 s
                        fail(f"rank {r}'s {op} took {e['t']:.1f} s > its timeout_s + 5 = {RAISE_BUILD_TIMEOUT + 5} s")
                    if e["ok"] or e["cls"] != "PeerTimeout" or phase not in (e["phase"] or "") \
                            or e["failing"] != v or str(v) not in e["msg"]:
                        fail(f"rank {r}'s {op} did not raise PeerTimeout naming the phase and rank {v}: {_fmt(e)}")
                    if op == "build1" and e.get("layer") != f"dl{sc['id']}.layers.1":
                        fail(f"rank {r}'s {op} error names layer {e.get('layer')!r}: {_fmt(e)}")
    assert not fails, "\n".join(fails)


def _check_prologue(res, W):
    fails = []
    rows = [{e["op"]: e for e in res[r]["prologue"]["log"]} for r in range(W)]
    for r in range(W):
        print(f"  prologue rank {r}: " + ", ".join(_fmt(e) for e in res[r]["prologue"]["log"]))
        late, ab, mm = rows[r]["late"], rows[r]["abandoned"], rows[r]["mismatch"]
        if late["ok"] or late["cls"] != "PeerTimeout" or late["failing"] != W - 1:
            fails.append(f"rank {r}: a rank that came after the deadline: not PeerTimeout naming it: {_fmt(late)}")
        if r == W - 1 and late["t"] - 2.0 > 1.0:
            fails.append(f"the late rank waited {late['t'] - 2.0:.1f} s after arriving, not at once: {_fmt(late)}")
        if res[r]["prologue"]["got"] != "from 1" or res[r]["prologue"]["mins"] != [5, -(W - 1)]:
            fails.append(f"rank {r}: the rendezvous after the faults went wrong: {res[r]['prologue']}")
        if r != 1 and (ab["ok"] or ab["cls"] != "PeerFault" or ab["failing"] != 1 or ab["t"] > 0.8):
            fails.append(f"rank {r}: a peer that failed between two rendezvous: not a PeerFault naming it "
                         f"at once: {_fmt(ab)}")
        if mm["ok"] or mm["cls"] != "PeerMismatch":
            fails.append(f"rank {r}: ranks at different rendezvous: not PeerMismatch: {_fmt(mm)}")
    assert not fails, "\n".join(fails)


def _matrix(W, recover):
    sc = []
    for mode in MODES:
        sc.append(dict(mode=mode, fault="skip", victim=W - 1, recover=recover))
    for mode in MODES:
        sc.append(dict(mode=mode, fault="raise", victim=1, reset=mode == "lane" and W == 2))
    for i, s in enumerate(sc):
        s["id"] = 10 * W + i
    return sc


def test_deadlines_w2(tmp_path):
    """W = 2, each tier mode: one rank skips a call, then every rank builds the same prefix again;
    one rank raises its own error and stops, its peer calls on and builds (and resets: lane)."""
    sc = _matrix(2, "same")
    res = _run(2, sc, tmp_path, budget_s=240)
    _check(res, 2, sc)


def test_deadlines_w3(tmp_path):
    """W = 3, each tier mode: as at W = 2, the skip followed by new prefixes; first the prologue
    (``Comm.exchange``: late, failed and mismatched ranks)."""
    sc = _matrix(3, "new")
    res = _run(3, sc, tmp_path, budget_s=240, prologue=True)
    _check_prologue(res, 3)
    _check(res, 3, sc)


# ------------------------------------------------------------------------------ in process
def test_loopback_rendezvous_have_a_deadline():
    """A LoopbackWorld's host rendezvous (rank threads of one process) end by the deadline too, the same
    way on every rank thread; a rank thread that fails between two rendezvous ends its peers' wait at
    once.  (The world's rendezvous only: a LoopbackWorld itself needs a GPU.)"""
    from k3tail.runtime.comm import LocalStore, host_deadline
    from k3tail.runtime.loopback import LoopbackGroup, LoopbackWorld

    def world(n):
        w = object.__new__(LoopbackWorld)
        w.world_size, w.store = n, LocalStore()
        return w

    w = world(2)
    alone = []

    def lonely():
        t0 = time.monotonic()
        try:
            with host_deadline(None, 0.3, slack_s=0.0, what="alone"):
                LoopbackGroup(w, 0).barrier()
            alone.append(("returned", time.monotonic() - t0, ""))
        except Exception as e:  # noqa: BLE001
            alone.append((type(e).__name__, time.monotonic() - t0, str(e)))

    t = threading.Thread(target=lonely, daemon=True)  # (a hang stays in its thread: the test asserts)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a loopback rank thread alone at a rendezvous still waits after 10 s"
    assert alone[0][0] == "PeerTimeout" and alone[0][1] < 2.0 and "rank(s) 1 did not arrive" in alone[0][2], alone
    w = world(3)
    got, errs = [None] * 3, [None] * 3

    def rank(r):
        g = LoopbackGroup(w, r)
        try:
            with host_deadline(g, 5.0, slack_s=0.0, what="trio"):
                got[r] = g.all_reduce_min([r + 1, 7])
                if r == 1:
                    raise ValueError("own error")
                g.barrier()
        except Exception as e:  # noqa: BLE001
            errs[r] = (type(e).__name__, getattr(e, "failing_rank", None), time.monotonic() - t0)

    t0 = time.monotonic()
    th = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(3)]
    for t in th:
        t.start()
    for t in th:
        t.join(10)
    assert not any(t.is_alive() for t in th), "loopback rank threads still wait after 10 s"
    assert got == [[1, 7]] * 3, got
    assert errs[1][0] == "ValueError", errs
    for r in (0, 2):
        assert errs[r][:2] == ("PeerFault", 1) and errs[r][2] < 2.0, errs
