"""cute_fallback.mnnvl: the sentinel import, the eligibility probe, the gating and the argument mapping,
against a FAKE flashinfer (tests/fakes/flashinfer; test_flashinfer_contract holds its signatures, checks
and profiles to the published release).  The real CuTe-DSL kernels are unverified here (no SM100)."""

import os
import sys

import pytest
import torch

from k3tail import reference as R
from k3tail import testing as T
from k3tail.cute_fallback import mnnvl
from k3tail.tiers import Tier
from k3tail.tiers import decide
from k3tail.vote import VOTE_FIELDS


def caps_from(agreed):
    d = decide(agreed, world_size=8)
    return d.alloc, d.why_not

FAKES = os.path.join(os.path.dirname(__file__), "fakes")


@pytest.fixture
def fake_flashinfer():
    sys.path.insert(0, FAKES)
    for m in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[m]
    mnnvl.reset_cache()
    import flashinfer.comm as fc
    fc.CALLS.clear()
    fc.reset_machine()
    yield fc
    sys.path.remove(FAKES)
    for m in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[m]
    mnnvl.reset_cache()


def test_sentinel_import_never_raises(monkeypatch):
    mnnvl.reset_cache()
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    assert mnnvl.import_flashinfer_comm() is None
    ok, why = mnnvl.backend_available()
    assert not ok and "flashinfer" in why
    mnnvl.reset_cache()


def test_broken_flashinfer_is_unavailable(tmp_path, monkeypatch):
    pkg = tmp_path / "flashinfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "comm.py").write_text("raise OSError('libcuda.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m.startswith("flashinfer")]:
        monkeypatch.delitem(sys.modules, m)
    mnnvl.reset_cache()
    assert mnnvl.import_flashinfer_comm() is None
    assert "OSError" in mnnvl.backend_available()[1]
    mnnvl.reset_cache()


def test_backend_present_with_fake(fake_flashinfer):
    assert mnnvl.backend_available() == (True, "")
    # an old flashinfer without the MoE-finalize pattern is not enough
    pat = fake_flashinfer.AllReduceFusionPattern
    saved = pat.kMoEFinalizeARResidualRMSNorm
    del pat.kMoEFinalizeARResidualRMSNorm
    try:
        ok, why = mnnvl.backend_available()
        assert not ok and "kMoEFinalizeARResidualRMSNorm" in why
    finally:
        pat.kMoEFinalizeARResidualRMSNorm = saved


def test_flashinfer_before_0_7_2_post1_is_not_possible(fake_flashinfer, monkeypatch):
    """Up to 0.7.2 there is no is_mnnvl_cutedsl_supported and create_allreduce_fusion_workspace takes
    no static options: reported as not possible (never an exception), naming the minimum version."""
    fake_flashinfer.MACHINE["capability"] = (10, 0)
    monkeypatch.delattr(fake_flashinfer, "is_mnnvl_cutedsl_supported")
    ok, why = mnnvl.backend_available()
    assert not ok and "0.7.2.post1" in why and "is_mnnvl_cutedsl_supported" in why
    assert mnnvl.supported_max_tokens(**_ASK) == (0, why)
    with pytest.raises(RuntimeError, match="0.7.2.post1"):
        mnnvl.CuteFinalize(None, rank=0, world_size=8, max_tokens=16, latent=7168, top_k=16, eps=1e-5,
                           routed_scale=1.0, dtype=torch.bfloat16, device=torch.device("cpu"), pdl=False)
    monkeypatch.undo()
    # a create function without the keyword-only options (0.7.2's signature) is refused as well

    def old_create(backend="auto", world_size=None, rank=None, max_token_num=None, hidden_dim=None, dtype=None,
                   gpus_per_node=None, comm_backend=None, force_oneshot_support=False, group=None):
        raise AssertionError("must not be called")
    monkeypatch.setattr(fake_flashinfer, "create_allreduce_fusion_workspace", old_create)
    ok, why = mnnvl.backend_available()
    assert not ok and "top_k" in why and "0.7.2.post1" in why, why


_ASK = dict(world_size=8, latent=7168, top_k=16, max_tokens=16, dtype=torch.bfloat16, eps=1e-5, routed_scale=1.0)


def test_supported_max_tokens_asks_flashinfer(fake_flashinfer):
    fc = fake_flashinfer
    # no Blackwell GPU (this host): flashinfer says no, the reason quotes the question
    cap, why = mnnvl.supported_max_tokens(**_ASK)
    assert cap == 0 and "is_mnnvl_cutedsl_supported(tp_size=8, hidden_dim=7168" in why and "is False" in why
    fc.MACHINE["capability"] = (10, 0)
    fc.CALLS.clear()
    assert mnnvl.supported_max_tokens(**_ASK) == (16, "")
    assert mnnvl.supported_max_tokens(**{**_ASK, "max_tokens": 64}) == (64, "")
    # asked once per question, with the static options the workspace is compiled with
    name, args, kw = fc.CALLS[0]
    assert name == "is_mnnvl_cutedsl_supported" and args == (8, 7168, torch.bfloat16)
    opts = mnnvl.workspace_options(top_k=16, eps=1e-5, routed_scale=1.0)
    assert kw == dict(max_token_num=16, device=None, **{k: opts[k] for k in mnnvl.PROBE_OPTIONS})
    assert kw["write_residual_output"] is False and kw["apply_rms_norm"] is True and kw["top_k"] == 16
    # K3's latent width has no default profile; W=3 and fp16 are outside the backend
    for over, text in ((dict(latent=3584), "hidden_dim=3584"), (dict(world_size=3), "W=3"),
                       (dict(dtype=torch.float16), "not bf16")):
        cap, why = mnnvl.supported_max_tokens(**{**_ASK, **over})
        assert cap == 0 and text in why, (over, why)
    fc.MACHINE["multicast"] = False
    assert mnnvl.supported_max_tokens(**_ASK)[0] == 0
    fc.MACHINE["multicast"] = True
    # values that cannot be compiled in, and a probe that raises: (0, reason), never an exception
    assert "eps" in mnnvl.supported_max_tokens(**{**_ASK, "eps": float("nan")})[1]
    assert "routed_scale" in mnnvl.supported_max_tokens(**{**_ASK, "routed_scale": float("inf")})[1]
    assert mnnvl.supported_max_tokens(**{**_ASK, "max_tokens": 0})[0] == 0

    def boom(*a, **k):
        raise RuntimeError("driver exploded")
    fc.is_mnnvl_cutedsl_supported = boom
    cap, why = mnnvl.supported_max_tokens(**_ASK)
    assert cap == 0 and "driver exploded" in why


def test_supported_max_tokens_without_flashinfer(monkeypatch):
    mnnvl.reset_cache()
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    cap, why = mnnvl.supported_max_tokens(**_ASK)
    assert cap == 0 and "flashinfer" in why
    mnnvl.reset_cache()


def _agreed(**over):
    a = {f: 1 for f in VOTE_FIELDS}
    a.update(sm=100, tail_max_tokens=16, lane_max_tokens=64, cute_max_tokens=16, multimem_max_tokens=8192)
    a.update(over)
    return a


def test_cute_gating():
    caps, why = caps_from(_agreed())
    assert caps.cute_max_tokens == 16 and Tier.CUTE_FINALIZE not in why
    for field, text in (("sm100_family", "SM100"), ("flashinfer_cute", "mnnvl-cutedsl"), ("multicast", "multicast"),
                        ("cute_max_tokens", "profile|is_mnnvl_cutedsl_supported"), ("p2p", "P2P")):
        caps, why = caps_from(_agreed(**{field: 0}))
        assert caps.cute_max_tokens == 0, field
        assert any(t in why[Tier.CUTE_FINALIZE] for t in text.split("|")), (field, why)


def test_argument_mapping(fake_flashinfer):
    """Against the fake (whose signatures and checks test_flashinfer_contract holds to the release)."""
    fc = fake_flashinfer
    fc.MACHINE["capability"] = (10, 0)
    M, K, Lt = 3, 16, 7168
    eo, w, idx = T.moe_triple(M, K, Lt, torch.bfloat16, 7)  # fp32 router weights
    gamma = T.randn((Lt,), torch.bfloat16, 8)
    group = object()
    op = mnnvl.CuteFinalize(group, rank=1, world_size=8, max_tokens=16, latent=Lt, top_k=K, eps=1e-5,
                            routed_scale=2.5, dtype=torch.bfloat16, device=torch.device("cpu"), pdl=True)
    name, args, kw = fc.CALLS[0]
    assert name == "create_allreduce_fusion_workspace" and args == ()
    assert kw["backend"] == "mnnvl-cutedsl" and kw["world_size"] == 8 and kw["rank"] == 1 and kw["group"] is group
    assert kw["max_token_num"] == 16 and kw["hidden_dim"] == Lt and kw["dtype"] == torch.bfloat16
    assert (kw["top_k"], kw["rms_eps"], kw["routed_scaling_factor"], kw["weight_bias"]) == (16, 1e-5, 2.5, 0.0)
    assert (kw["include_shared_expert"], kw["add_residual"], kw["write_residual_output"], kw["apply_rms_norm"]) == \
        (False, False, False, True)
    assert "comm_backend" not in kw and "gpus_per_node" not in kw
    ws = op.workspace
    assert (ws.top_k, ws.rms_eps, ws.routed_scaling_factor, ws.group) == (16, 1e-5, 2.5, group)
    normed = op(norm_weight=gamma, expert_out=eo, expert_weights=w, expanded_idx=idx)
    name, args, kw = fc.CALLS[-1]
    assert name == "allreduce_fusion" and args == ()
    assert kw["input"] is eo and kw["expanded_idx_to_permuted_idx"] is idx and kw["workspace"] is ws
    assert kw["expert_scale_factor"].dtype == torch.bfloat16 and torch.equal(kw["expert_scale_factor"], w.bfloat16())
    assert kw["pattern"] == fc.AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm
    assert kw["shared_expert_output"] is None and kw["residual_in"] is None and kw["residual_out"] is None
    assert "fp32_acc" not in kw and kw["launch_with_pdl"] is True
    assert kw["rms_gamma"] is gamma and kw["rms_eps"] == 1e-5 and kw["weight_bias"] == 0.0
    assert kw["norm_out"] is normed
    # world-of-one semantics of the fake: finalize (routed_scale applied once, by flashinfer) + RMSNorm
    ref = R.rmsnorm(R.finalize(eo, w.bfloat16(), idx, 2.5), gamma, 1e-5)
    st = T.check_ulp(normed, ref, max_ulp=1.0, frac=1.0, what="fake CUTE stage 1")
    print("fake CUTE stage 1 vs fp64:", st)
    # bf16 weights pass through untouched; an out tensor is filled
    wb = w.bfloat16()
    out = torch.empty(M, Lt, dtype=torch.bfloat16)
    assert op(norm_weight=gamma, expert_out=eo, expert_weights=wb, expanded_idx=idx, out=out) is out
    assert fc.CALLS[-1][2]["expert_scale_factor"] is wb and torch.equal(out, normed)
    e2, w2, i2 = T.moe_triple(17, K, Lt, torch.bfloat16, 9)
    with pytest.raises(ValueError, match="capacity"):
        op(norm_weight=gamma, expert_out=e2, expert_weights=w2, expanded_idx=i2)
    with pytest.raises(ValueError, match="int32"):
        op(norm_weight=gamma, expert_out=eo, expert_weights=w, expanded_idx=idx.long())
    with pytest.raises(ValueError, match="expert_out must have shape"):
        op(norm_weight=gamma, expert_out=eo[:, :128].contiguous(), expert_weights=w, expanded_idx=idx)
    with pytest.raises(ValueError, match="expert_weights must have shape"):
        op(norm_weight=gamma, expert_out=eo, expert_weights=w[:, :10], expanded_idx=idx)
    with pytest.raises(ValueError, match="bf16"):
        mnnvl.CuteFinalize(group, rank=1, world_size=8, max_tokens=16, latent=Lt, top_k=K, eps=1e-5,
                           routed_scale=1.0, dtype=torch.float16, device=torch.device("cpu"), pdl=True)


def test_module_gating_with_fake_on_cpu(fake_flashinfer):
    """flashinfer present but no SM100 GPU: the vote leaves CUTE_FINALIZE off, and says why."""
    import k3tail
    cfg = k3tail.TailConfig(hidden=64, latent=32, top_k=4, max_tokens=32)
    mod = k3tail.K3MoETail(cfg, prefix="cute.gating")
    assert mod.negotiated["local"]["flashinfer_cute"] == 1
    assert mod.caps.cute_max_tokens == 0
    assert "SM100" in mod.negotiated["why_not"]["CUTE_FINALIZE"]
    assert not [c for c in fake_flashinfer.CALLS if c[0] == "create_allreduce_fusion_workspace"]
    with pytest.raises(k3tail.TierUnavailable, match="CUTE_FINALIZE"):
        M = 2
        eo, w, idx = T.moe_triple(M, 4, 32, torch.bfloat16, 1)
        mod(prefix_hidden=T.randn((M, 64), torch.bfloat16, 2), shared=T.randn((M, 64), torch.bfloat16, 3),
            norm_weight=T.randn((32,), torch.bfloat16, 4), up_weight=T.randn((64, 32), torch.bfloat16, 5),
            expert_out=eo, expert_weights=w, expanded_idx=idx, tier=Tier.CUTE_FINALIZE)
