"""Fake ``flashinfer.comm``: records calls; computes a world-of-one result in fp64 so the
adapter's output can be checked (a real all-reduce is not simulated)."""

import torch

CALLS = []
ALLREDUCE_FUSION_BACKENDS = ("trtllm", "mnnvl", "mnnvl-cutedsl")


class AllReduceFusionPattern:
    kAllReduce = 0
    kARResidualRMSNorm = 1
    kMoEFinalizeARResidualRMSNorm = 7


class FakeWorkspace:
    def __init__(self, **kw):
        self.kw = kw
        self.backend = kw.get("backend")


def create_allreduce_fusion_workspace(**kw):
    CALLS.append(("create_allreduce_fusion_workspace", dict(kw)))
    return FakeWorkspace(**kw)


def allreduce_fusion(**kw):
    CALLS.append(("allreduce_fusion", dict(kw)))
    assert kw["pattern"] == AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm
    eo = kw["input"].double()
    idx = kw["expanded_idx_to_permuted_idx"].long()
    w = kw["expert_scale_factor"].double()
    s = torch.zeros(idx.shape[0], eo.shape[1], dtype=torch.float64)
    for k in range(idx.shape[1]):
        ok = idx[:, k] >= 0
        s[ok] += w[ok, k:k + 1] * eo[idx[ok, k]]
    s += kw["residual_in"].double()
    kw["residual_out"].copy_(s)
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + kw["rms_eps"]) * kw["rms_gamma"].double()
    kw["norm_out"].copy_(normed)
    return kw["norm_out"]
