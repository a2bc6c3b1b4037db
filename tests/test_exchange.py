"""PeerExchange (k3tail/exchange.py): CPU ranks under the interpreter over shared memory.

Each call runs the large-M tail's 4-phase sequence with a plain copy as the work (write
routed+shared -> B1 -> gather them, write stats -> B2 -> gather stats, write normed -> B3 ->
gather normed, write output -> B4 -> gather outputs), with fresh data every call, NaN-poisoned
outputs and random per-rank delays (a barrier that let a rank through early, or an area
rewritten too soon, shows up as stale or NaN bits).  Every rank regenerates what its peers wrote
and compares the bits with the torch twin."""

import random
import time

import pytest
import torch

import k3tail
from k3tail import testing as T
from k3tail.ops.exchange import PeerExchange, reference_gather_cols
from k3tail.triton_kernels.exchange import CTRL_EPOCH

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    return t.contiguous().view(_BITS[t.element_size()])


def _uneven(total_min, W, seed, zero_one=True):
    """W+1 non-decreasing bounds with uneven widths (one source may have width 0)."""
    g = random.Random(seed)
    widths = [g.randint(1, 7) for _ in range(W)]
    if zero_one and W > 1:
        widths[g.randrange(W)] = 0
    widths[0] = max(widths[0], total_min)
    b = [0]
    for w in widths:
        b.append(b[-1] + w)
    return b


def _case(W, seed, M, dtypes, slice_out=False):
    routed_dt, shared_dt, normed_dt, out_dt = dtypes
    lat = _uneven(1, W, seed)          # latent shards (normed all-gather)
    hid = _uneven(1, W, seed + 1)      # output shards (output all-gather)
    Lw, Hw = 9, 11                     # full partial widths (routed / shared pulls)
    return dict(W=W, seed=seed, M=M, dtypes=dtypes, lat=lat, hid=hid, Lw=Lw, Hw=Hw, slice_out=slice_out,
                areas={"routed": M * Lw * 4, "shared": M * Hw * shared_dt.itemsize, "stats": M * 8 + 8,
                       "normed": M * max(lat[s + 1] - lat[s] for s in range(W)) * normed_dt.itemsize,
                       "output": M * max(hid[s + 1] - hid[s] for s in range(W)) * out_dt.itemsize + 24})


def _data(c, call, rank):
    """What rank ``rank`` writes in call ``call`` (deterministic: peers regenerate it)."""
    M = c["M"]
    routed_dt, shared_dt, normed_dt, out_dt = c["dtypes"]
    s0 = 1_000_003 * c["seed"] + 1009 * call + 17 * rank
    return {
        "routed": T.randn((M, c["Lw"]), routed_dt, s0 + 1, scale=3.0),
        "shared": T.randn((M, c["Hw"]), shared_dt, s0 + 2),
        "stats": T.randn((M, 1), torch.float64, s0 + 3, scale=100.0),
        "normed": T.randn((M, c["lat"][rank + 1] - c["lat"][rank]), normed_dt, s0 + 4),
        "output": T.randn((M, c["hid"][rank + 1] - c["hid"][rank]), out_dt, s0 + 5, scale=0.5),
    }


def _jitter(g):
    time.sleep(g.random() * 0.02)


def _rank_sequence(rank, W, cases, calls):
    """Runs ``calls`` 4-phase calls per case; returns (n_checked, failures, epochs)."""
    failures, n_checked, epochs = [], 0, []
    g = random.Random(rank * 7919 + 1)
    for ci, c in enumerate(cases):
        ex = PeerExchange(areas=c["areas"], timeout_s=30.0)
        M = c["M"]
        for name, (off, _) in ex.areas.items():
            assert int(ex.peer_table(name)[rank]) == ex.area(name, torch.uint8, 1).data_ptr()
        full = lambda n: [n * s for s in range(W + 1)]  # noqa: E731

        def put(name, x):
            ex.area(name, x.dtype, x.numel()).copy_(x.reshape(-1))

        def pull(name, bounds, dtype, key, call):
            nonlocal n_checked
            N = bounds[-1]
            if c["slice_out"] and name == "output":  # a column slice of a wider tensor
                wide = T.poison_(torch.empty(M, N + 5, dtype=dtype))
                out = wide[:, 3:3 + N]
            else:
                out = T.poison_(torch.empty(M, N, dtype=dtype))
            _jitter(g)
            got = ex.gather_cols(name, M=M, bounds=bounds, dtype=dtype, out=out)
            assert got is out
            want = reference_gather_cols([_data(c, call, s)[key] for s in range(W)])
            n_checked += 1
            if not torch.equal(_bits(got), _bits(want)):
                failures.append(f"case {ci} call {call} {name}: rank {rank} got other bits")
            if c["slice_out"] and name == "output":
                if not torch.isnan(wide[:, :3]).all() or not torch.isnan(wide[:, 3 + N:]).all():
                    failures.append(f"case {ci} call {call}: gather wrote outside its column slice")

        routed_dt, shared_dt, normed_dt, out_dt = c["dtypes"]
        for call in range(calls):
            d = _data(c, call, rank)
            _jitter(g)
            put("routed", d["routed"])
            put("shared", d["shared"])
            ex.barrier()                                               # B1
            pull("routed", full(c["Lw"]), routed_dt, "routed", call)
            pull("shared", full(c["Hw"]), shared_dt, "shared", call)
            put("stats", d["stats"])
            ex.barrier()                                               # B2
            pull("stats", full(1), torch.float64, "stats", call)
            put("normed", d["normed"])
            ex.barrier()                                               # B3
            pull("normed", c["lat"], normed_dt, "normed", call)
            put("output", d["output"])
            ex.barrier()                                               # B4
            pull("output", c["hid"], out_dt, "output", call)
        epochs.append(int(ex.ws.ctrl[CTRL_EPOCH]))
        ex.check()
    return n_checked, failures, epochs


def _cases(W):
    return [_case(W, 10 * W + 1, 5, (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16)),
            _case(W, 10 * W + 2, 3, (torch.float32, torch.float16, torch.float16, torch.float16), slice_out=True)]


def _run(W, calls=5):
    t0 = time.time()
    res = k3tail.spawn(W, _rank_sequence, _cases(W), calls, timeout=240)
    for r, (n, failures, epochs) in enumerate(res):
        assert not failures, failures[:5]
        assert n == 2 * calls * 5, n
        assert epochs == ([4 * calls] * 2 if W > 1 else [0, 0]), epochs  # device-side epoch counter
    print(f"\nW={W}: {2 * calls} calls x 5 gathers checked on every rank in {time.time() - t0:.1f}s")


def test_cpu_w2_sequence():
    _run(2)


def test_cpu_w3_sequence():
    _run(3)


def test_cpu_w4_sequence():
    _run(4)


def test_cpu_w1_is_a_copy():
    _run(1)


# ------------------------------------------------------------ timeout, poison, bad inputs
def _rank_timeout(rank, W, timeout_s):
    res = {}
    # ranks that lay out different areas are told so (collectively, nobody hangs)
    try:
        PeerExchange(areas={"a": 256, "b": 512 + (rank == 1)})
        res["mismatch"] = "no error"
    except ValueError as e:
        res["mismatch"] = str(e)
    ex = PeerExchange(areas={"a": 3 * 8 * 4, "b": 64}, timeout_s=timeout_s)
    x = T.randn((3, 8), torch.float32, 5 + rank)
    ok = torch.empty(3, 8 * W)
    bounds = [8 * s for s in range(W + 1)]
    bad = {
        "area_unknown": lambda: ex.area("c", torch.float32, 4),
        "area_too_big": lambda: ex.area("b", torch.float32, 17),
        "area_dtype": lambda: ex.area("a", "float32", 4),
        "table_unknown": lambda: ex.peer_table("zz"),
        "gather_unknown": lambda: ex.gather_cols("c", M=3, bounds=bounds, dtype=torch.float32, out=ok),
        "gather_too_big": lambda: ex.gather_cols("a", M=4, bounds=bounds, dtype=torch.float32,
                                                 out=torch.empty(4, 8 * W)),
        "gather_out_dtype": lambda: ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.float32,
                                                   out=torch.empty(3, 8 * W, dtype=torch.float16)),
        "gather_dtype": lambda: ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.complex64, out=ok),
        "gather_device": lambda: ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.float32,
                                                out=torch.empty(3, 8 * W, device="meta")),
        "gather_shape": lambda: ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.float32,
                                               out=torch.empty(3, 8 * W + 1)),
        "gather_stride": lambda: ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.float32,
                                                out=torch.empty(8 * W, 3).t()),
        "bounds_len": lambda: ex.gather_cols("a", M=3, bounds=bounds[:-1], dtype=torch.float32, out=ok),
        "bounds_order": lambda: ex.gather_cols("a", M=3, bounds=[0] + bounds[:0:-1], dtype=torch.float32,
                                               out=ok),
    }
    res["bad"] = {}
    for name, f in bad.items():
        try:
            f()
            res["bad"][name] = "no error"
        except ValueError as e:
            res["bad"][name] = str(e)
    ex.area("a", torch.float32, x.numel()).copy_(x.reshape(-1))  # one good phase after the rejections
    ex.barrier()
    res["ok"] = (x, ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.float32, out=T.poison_(ok)).clone())
    ex.barrier()  # nobody rewrites "a" before every rank has read it
    if rank == W - 1:
        time.sleep(timeout_s + 3.0)  # skip the next barrier; stay alive while the others time out
        res["skipped"] = True
        return res
    for key in ("first", "second", "gather"):
        t0 = time.monotonic()
        try:
            if key == "gather":
                ex.gather_cols("a", M=3, bounds=bounds, dtype=torch.float32, out=ok)
            else:
                ex.barrier()
            res[key] = "no error"
        except k3tail.PeerTimeout as e:
            res[key] = (type(e).__name__, str(e), time.monotonic() - t0)
    try:
        ex.check()
        res["check"] = "no error"
    except k3tail.WorkspacePoisoned as e:
        res["check"] = type(e).__name__
    return res


def test_cpu_timeout_poison_and_bad_inputs():
    W, timeout_s = 3, 2.0
    res = k3tail.spawn(W, _rank_timeout, timeout_s, timeout=120)
    xs = [res[q]["ok"][0] for q in range(W)]
    for r in range(W):
        assert "different areas" in res[r]["mismatch"], res[r]["mismatch"]
        for name, msg in res[r]["bad"].items():
            assert msg != "no error", f"rank {r}: bad input {name!r} was accepted"
        assert torch.equal(_bits(res[r]["ok"][1]), _bits(reference_gather_cols(xs)))
    bad = res[0]["bad"]
    assert "unknown area" in bad["area_unknown"] and "unknown area" in bad["gather_unknown"]
    assert "holds" in bad["area_too_big"] and "holds" in bad["gather_too_big"]
    assert "dtype" in bad["gather_out_dtype"] and "must be on" in bad["gather_device"]
    assert "stride" in bad["gather_stride"] and "bounds" in bad["bounds_order"]
    for r in range(W - 1):
        kind, msg, waited = res[r]["first"]
        assert kind == "PeerTimeout", res[r]["first"]
        assert f"rank {r}" in msg and f"world size {W}" in msg and "PeerExchange" in msg
        assert timeout_s - 0.1 <= waited <= timeout_s + 5.0, waited
        for key in ("second", "gather"):
            kind2, _, waited2 = res[r][key]
            assert kind2 == "WorkspacePoisoned" and waited2 < 0.5, res[r][key]
        assert res[r]["check"] == "WorkspacePoisoned"
    assert res[W - 1]["skipped"]


def test_construction_errors():
    with pytest.raises(ValueError, match="non-empty dict"):
        PeerExchange(areas={})
    with pytest.raises(ValueError, match="positive int"):
        PeerExchange(areas={"a": 0})
    with pytest.raises(ValueError, match="positive int"):
        PeerExchange(areas={"a": 1.5})
    with pytest.raises(ValueError, match="timeout_s"):
        PeerExchange(areas={"a": 64}, timeout_s=0)
