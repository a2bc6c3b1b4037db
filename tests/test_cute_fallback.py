"""cute_fallback.mnnvl: the sentinel import, the gating and the argument mapping, against a FAKE
flashinfer (tests/fakes/flashinfer).  The real CuTe-DSL kernels are unverified here (no SM100)."""

import os
import sys

import pytest
import torch

from k3tail import reference as R
from k3tail import testing as T
from k3tail.cute_fallback import mnnvl
from k3tail.tiers import Tier
from k3tail.vote import caps_from, VOTE_FIELDS

FAKES = os.path.join(os.path.dirname(__file__), "fakes")


@pytest.fixture
def fake_flashinfer():
    sys.path.insert(0, FAKES)
    for m in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[m]
    mnnvl.reset_cache()
    import flashinfer.comm as fc
    fc.CALLS.clear()
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


def test_profiles():
    assert mnnvl.profile_max_tokens(width=3584, top_k=16, dtype=torch.bfloat16, world_size=8) == 16
    assert mnnvl.profile_max_tokens(width=3584, top_k=16, dtype=torch.bfloat16, world_size=3) == 0
    assert mnnvl.profile_max_tokens(width=3584, top_k=16, dtype=torch.float16, world_size=8) == 0
    assert mnnvl.profile_max_tokens(width=128, top_k=4, dtype=torch.bfloat16, world_size=8) == 0


def _agreed(**over):
    a = {f: 1 for f in VOTE_FIELDS}
    a.update(sm=100, tail_max_tokens=16, lane_max_tokens=64, cute_max_tokens=16, multimem_max_tokens=8192)
    a.update(over)
    return a


def test_cute_gating():
    caps, why = caps_from(_agreed())
    assert caps.cute_max_tokens == 16 and Tier.CUTE_FINALIZE not in why
    for field, text in (("sm100_family", "SM100"), ("flashinfer_cute", "mnnvl-cutedsl"), ("multicast", "multicast"),
                        ("cute_max_tokens", "profile"), ("p2p", "P2P")):
        caps, why = caps_from(_agreed(**{field: 0}))
        assert caps.cute_max_tokens == 0, field
        assert text in why[Tier.CUTE_FINALIZE], (field, why)


def test_argument_mapping(fake_flashinfer):
    M, K, Lt = 3, 16, 3584
    eo, w, idx = T.moe_triple(M, K, Lt, torch.bfloat16, 7)
    gamma = T.randn((Lt,), torch.bfloat16, 8)
    op = mnnvl.CuteFinalize(None, rank=1, world_size=8, max_tokens=16, latent=Lt, top_k=K, eps=1e-5,
                            routed_scale=1.0, dtype=torch.bfloat16, device=torch.device("cpu"), pdl=True)
    name, kw = fake_flashinfer.CALLS[0]
    assert name == "create_allreduce_fusion_workspace"
    assert kw["backend"] == "mnnvl-cutedsl" and kw["world_size"] == 8 and kw["rank"] == 1
    assert kw["max_token_num"] == 16 and kw["hidden_dim"] == Lt and kw["dtype"] == torch.bfloat16
    normed = op(norm_weight=gamma, expert_out=eo, expert_weights=w, expanded_idx=idx)
    name, kw = fake_flashinfer.CALLS[1]
    assert name == "allreduce_fusion"
    assert kw["input"] is eo and kw["expanded_idx_to_permuted_idx"] is idx and kw["expert_scale_factor"] is w
    assert kw["pattern"] == fake_flashinfer.AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm
    assert kw["shared_expert_output"] is None and kw["fp32_acc"] is True and kw["launch_with_pdl"] is True
    assert kw["rms_gamma"] is gamma and kw["rms_eps"] == 1e-5 and kw["workspace"] is op.workspace
    assert kw["residual_in"].shape == (M, Lt) and not kw["residual_in"].any()
    assert kw["norm_out"] is normed
    # world-of-one semantics of the fake: the adapter's output is the finalize + RMSNorm
    ref = R.rmsnorm(R.finalize(eo, w, idx), gamma, 1e-5)
    st = T.check_ulp(normed, ref, max_ulp=1.0, frac=1.0, what="fake CUTE stage 1")
    print("fake CUTE stage 1 vs fp64:", st)
    # routed_scale != 1 scales the weights (fp32)
    op2 = mnnvl.CuteFinalize(None, rank=0, world_size=8, max_tokens=16, latent=Lt, top_k=K, eps=1e-5,
                             routed_scale=2.5, dtype=torch.bfloat16, device=torch.device("cpu"), pdl=False)
    op2(norm_weight=gamma, expert_out=eo, expert_weights=w, expanded_idx=idx)
    kw = fake_flashinfer.CALLS[-1][1]
    assert torch.equal(kw["expert_scale_factor"], w.float() * 2.5) and kw["launch_with_pdl"] is False
    with pytest.raises(ValueError, match="capacity"):
        e2, w2, i2 = T.moe_triple(17, K, Lt, torch.bfloat16, 9)
        op(norm_weight=gamma, expert_out=e2, expert_weights=w2, expanded_idx=i2)


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
