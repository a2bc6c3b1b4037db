"""CUTE_FINALIZE's contract with the real flashinfer-python, checked without a GPU.

The wheel of the newest release (or ``K3TAIL_FLASHINFER_VERSION`` / ``K3TAIL_FLASHINFER_WHEEL``) is
fetched with ``pip download --no-deps`` into ``~/.cache/k3tail/flashinfer``; without network (and no
cached wheel) every test here skips, saying why.  What is checked (``tests/fi_contract.py``):

1. the real signatures of ``create_allreduce_fusion_workspace``, ``allreduce_fusion``,
   ``is_mnnvl_cutedsl_supported`` and the mnnvl-cutedsl workspace constructor, read with ``ast``;
2. the fake ``flashinfer`` (``tests/fakes``) has exactly those signatures, pattern constants and
   profile keys, and rejects what the release rejects;
3. every call the adapter makes (recorded by the fake) binds to the real signatures, passes every
   keyword-only static option at construction, and calls with the compiled values;
4. the adapter runs through the release's own Python layer (argument checks, profile resolution,
   eligibility probe) with only the CuTe kernels and device queries stubbed.
"""

import importlib.util
import os
import re
import sys

import pytest
import torch

from k3tail import reference as R
from k3tail import testing as T
from k3tail.cute_fallback import mnnvl

HERE = os.path.dirname(os.path.abspath(__file__))
FAKES = os.path.join(HERE, "fakes")
BF16 = torch.bfloat16


def _load_helper():
    spec = importlib.util.spec_from_file_location("k3tail_tests_fi_contract", os.path.join(HERE, "fi_contract.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


C = _load_helper()


@pytest.fixture(scope="module")
def src():
    try:
        wheel = C.obtain_wheel()
    except C.Unavailable as e:
        pytest.skip(f"real flashinfer-python not available: {e}")
    s = C.FlashinferSource(wheel)
    print(f"checking against flashinfer-python {s.version} ({s.wheel})")
    return s


@pytest.fixture(scope="module")
def sigs(src):
    return C.real_signatures(src)


@pytest.fixture(scope="module")
def pattern(src):
    cls = C.real_class(src, "flashinfer/comm/trtllm_ar.py", "AllReduceFusionPattern")
    return cls.kMoEFinalizeARResidualRMSNorm


def _drop_flashinfer_modules():
    for m in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[m]


@pytest.fixture
def fake():
    _drop_flashinfer_modules()
    sys.path.insert(0, FAKES)
    mnnvl.reset_cache()
    import flashinfer.comm as fc
    fc.CALLS.clear()
    fc.reset_machine()
    try:
        yield fc
    finally:
        sys.path.remove(FAKES)
        _drop_flashinfer_modules()
        mnnvl.reset_cache()


@pytest.fixture
def real_layer(src):
    """Enter with ``with real_layer(machine) as layer``: flashinfer.comm is the release's own code."""
    _drop_flashinfer_modules()

    class _Ctx:
        def __init__(self, machine=None):
            self.layer = C.RealLayer(src, machine)

        def __enter__(self):
            mnnvl.reset_cache()
            return self.layer.__enter__()

        def __exit__(self, *exc):
            mnnvl.reset_cache()
            return self.layer.__exit__(*exc)
    yield _Ctx
    mnnvl.reset_cache()


# An eligible shape in flashinfer's DEFAULT_CONFIG (TP8, width 7168, top-k 16), with K3's eps and a
# routed scale != 1 so a double application would show.
SHAPE = dict(world_size=8, rank=1, latent=7168, top_k=16, max_tokens=16, eps=1e-5, routed_scale=2.5)


def _run_adapter(group, *, M=5, weight_dtype=torch.float32, seed=3, **over):
    s = {**SHAPE, **over}
    cap, why = mnnvl.supported_max_tokens(world_size=s["world_size"], latent=s["latent"], top_k=s["top_k"],
                                          max_tokens=s["max_tokens"], dtype=BF16, eps=s["eps"],
                                          routed_scale=s["routed_scale"])
    op = mnnvl.CuteFinalize(group, rank=s["rank"], world_size=s["world_size"], max_tokens=s["max_tokens"],
                            latent=s["latent"], top_k=s["top_k"], eps=s["eps"], routed_scale=s["routed_scale"],
                            dtype=BF16, device=torch.device("cpu"), pdl=True)
    eo, w, idx = T.moe_triple(M, s["top_k"], s["latent"], BF16, seed, weight_dtype=weight_dtype)
    gamma = T.randn((s["latent"],), BF16, seed + 1)
    out = op(norm_weight=gamma, expert_out=eo, expert_weights=w, expanded_idx=idx)
    ref = R.rmsnorm(R.finalize(eo, w.to(BF16), idx, s["routed_scale"]), gamma, s["eps"])
    return dict(cap=cap, why=why, op=op, eo=eo, w=w, idx=idx, gamma=gamma, out=out, ref=ref, shape=s)


# ------------------------------------------------------------------------------ the real API
def test_real_api_takes_what_the_adapter_passes(src, sigs):
    for name, sig in sigs.items():
        print(f"flashinfer-python {src.version} {name}{sig}")
    create = sigs["create_allreduce_fusion_workspace"].parameters
    static = mnnvl.workspace_options(top_k=16, eps=1e-5, routed_scale=1.0)
    kwonly = {n for n, p in create.items() if p.kind is p.KEYWORD_ONLY}
    assert set(static) == kwonly, (f"flashinfer {src.version}: create_allreduce_fusion_workspace's keyword-only "
                                   f"static options {sorted(kwonly)} != what the adapter compiles {sorted(static)}")
    assert "group" in create
    probe = sigs["is_mnnvl_cutedsl_supported"].parameters
    assert list(probe)[:3] == ["tp_size", "hidden_dim", "dtype"], list(probe)
    probe_static = {n for n, p in probe.items() if p.kind is p.KEYWORD_ONLY} & kwonly
    assert probe_static == set(mnnvl.PROBE_OPTIONS), (sorted(probe_static), mnnvl.PROBE_OPTIONS)
    exported = C.exported_from_comm(src)
    for name in ("create_allreduce_fusion_workspace", "allreduce_fusion", "is_mnnvl_cutedsl_supported",
                 "AllReduceFusionPattern"):
        assert name in exported, f"flashinfer.comm of {src.version} does not export {name}"


def test_extra_admits_the_checked_release(src):
    text = open(os.path.join(HERE, os.pardir, "pyproject.toml")).read()
    m = re.search(r'^flashinfer = \["flashinfer-python([^"]*)"\]', text, re.M)
    assert m, "pyproject.toml has no flashinfer extra"
    from packaging.specifiers import SpecifierSet
    spec = SpecifierSet(m.group(1))
    assert spec.contains(src.version, prereleases=True), (
        f"the contract passes for flashinfer-python {src.version} (if the tests below pass) but the "
        f"flashinfer extra {spec} excludes it: widen the extra after checking the release")
    assert spec.contains(mnnvl.MIN_FLASHINFER) and not spec.contains("0.7.2"), spec


# ------------------------------------------------------------------------------ the fake
def test_fake_mirrors_real_signatures(sigs, fake):
    import inspect
    probs = []
    for name in C.PUBLIC:
        probs += C.signature_diff(sigs[name], inspect.signature(getattr(fake, name)), f"fake {name}")
    ws = inspect.signature(fake.MNNVLCuteDSLAllReduceFusionWorkspace.__init__)
    ws = ws.replace(parameters=list(ws.parameters.values())[1:])
    probs += C.signature_diff(sigs[C.WORKSPACE], ws, f"fake {C.WORKSPACE}")
    assert not probs, "the fake flashinfer drifted from the release:\n" + "\n".join(probs)


def test_fake_pattern_constants_mirror_real(src, fake):
    """The fake has 0.7.2.post1's patterns (the oldest release the adapter takes); each must exist in the
    checked release with the same value (newer releases add patterns, e.g. 0.7.4's MXFP8 ones)."""
    real = C.pattern_constants(C.real_class(src, "flashinfer/comm/trtllm_ar.py", "AllReduceFusionPattern"))
    mine = C.pattern_constants(fake.AllReduceFusionPattern)
    assert mine["kMoEFinalizeARResidualRMSNorm"] == real.get("kMoEFinalizeARResidualRMSNorm")
    wrong = {k: (v, real.get(k)) for k, v in mine.items() if real.get(k) != v}
    assert not wrong, f"fake AllReduceFusionPattern differs from flashinfer-python {src.version}: {wrong}"


def test_signature_diff_detects_drift(sigs):
    import inspect
    real = sigs["allreduce_fusion"]
    ps = list(real.parameters.values())
    renamed = real.replace(parameters=[p.replace(name="rms_epsilon") if p.name == "rms_eps" else p for p in ps])
    redefault = real.replace(parameters=[p.replace(default=1e-5) if p.name == "rms_eps" else p for p in ps])
    rekind = real.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.name == "weight_bias"
                                      else p for p in ps])
    assert any("rms_epsilon" in d for d in C.signature_diff(real, renamed, "x"))
    assert any("rms_eps default" in d for d in C.signature_diff(real, redefault, "x"))
    assert any("weight_bias is KEYWORD_ONLY" in d for d in C.signature_diff(real, rekind, "x"))
    assert C.signature_diff(real, real, "x") == []


def test_fake_profiles_mirror_real(real_layer, fake):
    want = {name: dict(t) for name, t in fake.PROFILES.items()}
    _drop_flashinfer_modules()
    with real_layer() as layer:
        got = {name: layer.profiles(name) for name in want}
    assert got == want, f"flashinfer's profile keys changed: real {got}"


# ------------------------------------------------------------------ the adapter's calls
def test_adapter_calls_bind_to_real_signatures(sigs, pattern, src, fake):
    fake.MACHINE["capability"] = (10, 0)
    group = C.FakeGroup(1, 8)
    try:  # the fake records each call before binding it: check the calls even if one raised
        r, err = _run_adapter(group), None
    except Exception as e:  # noqa: BLE001
        r, err = None, e
    probs = C.check_calls(fake.CALLS, sigs, pattern=pattern, version=src.version)
    assert not probs, f"the adapter's calls break the flashinfer-python {src.version} contract:\n" + "\n".join(probs)
    if err is not None:
        raise err
    assert (r["cap"], r["why"]) == (16, "")
    create = [c for c in fake.CALLS if c[0] == "create_allreduce_fusion_workspace"]
    assert len(create) == 1
    c = C.compiled_options(create[0], sigs)
    # what k3tail's tail needs compiled in (and routed_scale not also applied to the weights)
    assert c["hidden_dim"] == 7168 and c["top_k"] == 16 and c["max_token_num"] == 16 and c["dtype"] == BF16
    assert (c["world_size"], c["rank"]) == (8, 1) and create[0][2]["group"] is group
    assert c["rms_eps"] == 1e-5 and c["routed_scaling_factor"] == 2.5 and c["weight_bias"] == 0.0
    assert c["include_shared_expert"] is False and c["add_residual"] is False
    assert c["write_residual_output"] is False and c["apply_rms_norm"] is True
    call = [kw for n, _, kw in fake.CALLS if n == "allreduce_fusion"]
    assert len(call) == 1
    assert torch.equal(call[0]["expert_scale_factor"], r["w"].to(BF16)), "weights must not be pre-scaled"
    assert call[0]["norm_out"] is r["out"]
    T.check_ulp(r["out"], r["ref"], max_ulp=1.0, frac=1.0, what="adapter on the fake")


def _good_calls(fake, sigs):
    fake.MACHINE["capability"] = (10, 0)
    _run_adapter(C.FakeGroup(1, 8))
    return list(fake.CALLS)


def _mutate(calls, name, **changes):
    out = []
    for n, a, kw in calls:
        if n == name:
            kw = dict(kw)
            for k, v in changes.items():
                if v is _DROP:
                    kw.pop(k, None)
                elif k.startswith("rename:"):
                    old, new = k[len("rename:"):], v
                    kw[new] = kw.pop(old)
                else:
                    kw[k] = v
        out.append((n, a, kw))
    return out


_DROP = object()


def test_contract_check_detects_wrong_calls(sigs, pattern, src, fake):
    good = _good_calls(fake, sigs)
    ar = next(kw for n, _, kw in good if n == "allreduce_fusion")
    m = ar["expanded_idx_to_permuted_idx"].shape[0]
    cases = {
        "misspelled keyword": (_mutate(good, "allreduce_fusion", **{"rename:rms_eps": "rms_epsilon"}),
                               "does not bind"),
        "static option left to flashinfer's default": (_mutate(good, "create_allreduce_fusion_workspace",
                                                               top_k=_DROP), "['top_k']"),
        "no group": (_mutate(good, "create_allreduce_fusion_workspace", group=_DROP), "group not passed"),
        "comm_backend": (_mutate(good, "create_allreduce_fusion_workspace", comm_backend=object()),
                         "comm_backend passed"),
        "eps differs from compiled": (_mutate(good, "allreduce_fusion", rms_eps=1e-6), "rms_eps"),
        "zero residual on a residual-free workspace": (
            _mutate(good, "allreduce_fusion", residual_in=torch.zeros(m, 7168, dtype=BF16)), "residual_in passed"),
        "prenorm output on a workspace without it": (
            _mutate(good, "allreduce_fusion", residual_out=torch.zeros(m, 7168, dtype=BF16)), "residual_out"),
        "fp32_acc": (_mutate(good, "allreduce_fusion", fp32_acc=True), "fp32_acc"),
        "fp32 router weights": (
            _mutate(good, "allreduce_fusion", expert_scale_factor=ar["expert_scale_factor"].float()),
            "expert_scale_factor torch.float32"),
        "top_k 10 weights": (_mutate(good, "allreduce_fusion", expert_scale_factor=torch.zeros(m, 10, dtype=BF16)),
                             "(compiled top_k)"),
        "probe asked other options": (_mutate(good, "is_mnnvl_cutedsl_supported", write_residual_output=True),
                                      "probe was asked write_residual_output=True"),
        "wrong pattern": (_mutate(good, "allreduce_fusion", pattern=1), "pattern 1"),
    }
    for what, (calls, text) in cases.items():
        probs = C.check_calls(calls, sigs, pattern=pattern, version=src.version)
        assert any(text in p for p in probs), f"{what}: expected a problem with {text!r}, got {probs}"


# --------------------------------------------------------- through flashinfer's own Python layer
def test_adapter_on_real_python_layer(real_layer):
    group = C.FakeGroup(1, 8)
    with real_layer(C.Machine(capability=(10, 0))) as layer:
        r = _run_adapter(group)
        ws = r["op"].workspace
        assert type(ws).__name__ == C.WORKSPACE and ws.backend == "mnnvl-cutedsl"
        assert (ws.rms_eps, ws.top_k, ws.hidden_dim, ws.max_token_num, ws.group) == (1e-5, 16, 7168, 16, group)
        # the kernels were compiled (here: the stub protocols built) with k3tail's options
        assert layer.protocols, "no protocol was built"
        for p in layer.protocols:
            kw = p.kw
            assert (kw["rms_epsilon"], kw["routed_scaling_factor"], kw["weight_bias"]) == (1e-5, 2.5, 0.0), kw
            assert (kw["include_shared_expert"], kw["add_residual"], kw["write_residual_output"],
                    kw["apply_rms_norm"]) == (False, False, False, True), kw
            assert (kw["top_k"], kw["hidden_size"], kw["tp_size"], kw["rank"], kw["group"]) == (16, 7168, 8, 1, group)
        assert len(layer.launches) == 1
        launch = layer.launches[0]
        assert launch["shared_output"] is None and launch["residual_source"] is None
        assert torch.equal(launch["expert_weights"], r["w"].to(BF16)) and launch["norm_output"] is r["out"]
        assert (r["cap"], r["why"]) == (16, "")
        T.check_ulp(r["out"], r["ref"], max_ulp=1.0, frac=1.0, what="adapter through flashinfer's Python layer")
        # bf16 weights go through as they are; the result is the same
        r2 = _run_adapter(group, weight_dtype=BF16, M=16)
        T.check_ulp(r2["out"], r2["ref"], max_ulp=1.0, frac=1.0, what="bf16 weights, M = capacity")
        # without the TP group flashinfer rendezvouses over WORLD (here rank 0 of 8): it refuses
        with pytest.raises(ValueError, match="rank does not match"):
            mnnvl.CuteFinalize(None, rank=1, world_size=8, max_tokens=16, latent=7168, top_k=16, eps=1e-5,
                               routed_scale=1.0, dtype=BF16, device=torch.device("cpu"), pdl=True)


ELIGIBILITY = [  # (machine, world_size, latent, top_k, dtype) -> eligible?
    ((10, 0), True, 8, 7168, 16, BF16, True),
    ((10, 3), True, 4, 7168, 16, BF16, True),
    ((10, 0), True, 8, 3584, 16, BF16, False),   # K3's latent: no DEFAULT_CONFIG profile
    ((10, 0), True, 4, 3584, 16, BF16, False),
    ((10, 0), True, 8, 7168, 8, BF16, False),    # DeepSeek-style top-8: no profile
    ((10, 0), True, 3, 7168, 16, BF16, False),   # W=3
    ((10, 0), True, 8, 7168, 16, torch.float16, False),
    ((10, 0), False, 8, 7168, 16, BF16, False),  # no multicast
    ((9, 0), True, 8, 7168, 16, BF16, False),    # Hopper
    (None, True, 8, 7168, 16, BF16, False),      # no CUDA
    ((10, 3), True, 4, 8192, 10, BF16, True),    # GB300-specific profile
    ((10, 0), True, 4, 8192, 10, BF16, False),   # ... which B200 does not get
]


def _ask(W, latent, K, dtype):
    return mnnvl.supported_max_tokens(world_size=W, latent=latent, top_k=K, max_tokens=16, dtype=dtype, eps=1e-5,
                                      routed_scale=1.0)


def test_eligibility_is_flashinfers_and_the_fake_agrees(real_layer, fake):
    fake_verdicts = []
    for cc, mc, W, latent, K, dtype, _ in ELIGIBILITY:
        fake.MACHINE.update(capability=cc, multicast=mc)
        fake_verdicts.append(_ask(W, latent, K, dtype))
    _drop_flashinfer_modules()
    for (cc, mc, W, latent, K, dtype, want), (fcap, fwhy) in zip(ELIGIBILITY, fake_verdicts):
        with real_layer(C.Machine(capability=cc, multicast=mc, world=C.FakeGroup(0, W))):
            cap, why = _ask(W, latent, K, dtype)
        case = f"cc={cc} multicast={mc} W={W} latent={latent} top_k={K} {dtype}"
        assert (cap > 0) == want, f"{case}: flashinfer says {(cap, why)}, expected eligible={want}"
        assert (cap, why == "") == ((16, True) if want else (0, False)), (case, cap, why)
        assert (fcap > 0) == want, f"{case}: the fake says {(fcap, fwhy)} but flashinfer says {(cap, why)}"
        if not want:
            assert "is_mnnvl_cutedsl_supported(" in why and "is False" in why, why
    # K3's reason names the missing profile (read from flashinfer's DEFAULT_CONFIG)
    with real_layer(C.Machine(capability=(10, 0))):
        cap, why = _ask(8, 3584, 16, BF16)
    assert cap == 0 and "DEFAULT_CONFIG has no profile for (tp_size=8, hidden_dim=3584, top_k=16)" in why, why
    print("K3 latent:", why)


BAD_CALLS = {  # what the release rejects; the fake must reject it too
    "rms_eps mismatch": dict(rms_eps=1e-6),
    "residual_in on a residual-free workspace": "residual_in",
    "fp32_acc": dict(fp32_acc=True),
    "fp32 weights": "fp32_weights",
    "shared expert on a workspace without": "shared",
    "misspelled keyword": dict(rms_epsilon=1e-5),
    "top_k 10 weights": "k10",
}


def _bad_call(fi, how):
    M, K, Lt = 3, 16, 7168
    eo, w, idx = T.moe_triple(M, K, Lt, BF16, 11, weight_dtype=BF16)
    opts = mnnvl.workspace_options(top_k=K, eps=1e-5, routed_scale=1.0)
    ws = fi.create_allreduce_fusion_workspace(backend="mnnvl-cutedsl", world_size=8, rank=0, max_token_num=16,
                                              hidden_dim=Lt, dtype=BF16, group=C.FakeGroup(0, 8), **opts)
    kw = dict(input=eo, workspace=ws, pattern=fi.AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm,
              launch_with_pdl=True, norm_out=torch.empty(M, Lt, dtype=BF16), rms_gamma=T.randn((Lt,), BF16, 1),
              rms_eps=1e-5, expanded_idx_to_permuted_idx=idx, expert_scale_factor=w)
    fi.allreduce_fusion(**kw)  # the good call passes
    if how == "residual_in":
        kw["residual_in"] = torch.zeros(M, Lt, dtype=BF16)
    elif how == "fp32_weights":
        kw["expert_scale_factor"] = w.float()
    elif how == "shared":
        kw["shared_expert_output"] = torch.zeros(M, Lt, dtype=BF16)
    elif how == "k10":
        kw["expert_scale_factor"] = w[:, :10].contiguous()
    else:
        kw.update(how)
    fi.allreduce_fusion(**kw)


def test_fake_rejects_what_the_release_rejects(real_layer, fake):
    fake.MACHINE["capability"] = (10, 0)
    fake_errors = {}
    for what, how in BAD_CALLS.items():
        with pytest.raises((ValueError, TypeError)) as e:
            _bad_call(fake, how)
        fake_errors[what] = e.type
    _drop_flashinfer_modules()
    with real_layer(C.Machine(capability=(10, 0))) as layer:
        for what, how in BAD_CALLS.items():
            with pytest.raises((ValueError, TypeError)) as e:
                _bad_call(layer.comm, how)
            assert e.type is fake_errors[what], (what, e.type, fake_errors[what], e.value)
            print(f"{what}: flashinfer raises {e.type.__name__}: {e.value}")
        with pytest.raises(ValueError, match="does not use: comm_backend"):
            layer.comm.create_allreduce_fusion_workspace(backend="mnnvl-cutedsl", world_size=8, rank=0,
                                                         max_token_num=16, hidden_dim=7168, dtype=BF16,
                                                         comm_backend=object())
