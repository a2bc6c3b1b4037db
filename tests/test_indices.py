"""Out-of-range expert indices raise ValueError naming expanded_idx before anything runs, in
every op that takes the deferred finalize triple (world of one, CPU)."""

import pytest
import torch

from k3tail import testing as T

M, K, L, H = 3, 4, 128, 256


def _triple(bad_value):
    eo, w, idx = T.moe_triple(M, K, L, torch.bfloat16, seed=5)
    idx = idx.clone()
    idx[1, 2] = bad_value
    return dict(expert_out=eo, expert_weights=w, expanded_idx=idx)


def _finalize(tr):
    from k3tail.ops.finalize_ar_norm import FinalizeAllReduceRMSNorm

    op = FinalizeAllReduceRMSNorm(width=L, max_tokens=4, top_k=K)
    return op(norm_weight=torch.ones(L, dtype=torch.bfloat16), **tr)


def _tail(tr):
    from k3tail.ops.tail import LatentTail

    tail = LatentTail(hidden=H, latent=L, top_k=K, key="indices.test", max_tokens=4)
    return tail(prefix_hidden=T.randn((M, H), torch.bfloat16, 1), shared=T.randn((M, H), torch.bfloat16, 2),
                norm_weight=torch.ones(L, dtype=torch.bfloat16),
                up_weight=T.randn((H, L), torch.bfloat16, 3, scale=L ** -0.5), **tr)


def _module(tr):
    from k3tail.config import TailConfig
    from k3tail.module import K3MoETail

    mod = K3MoETail(TailConfig(hidden=H, latent=L, top_k=K, max_tokens=4), prefix="indices.test.mod")
    return mod(prefix_hidden=T.randn((M, H), torch.bfloat16, 1), shared=T.randn((M, H), torch.bfloat16, 2),
               norm_weight=torch.ones(L, dtype=torch.bfloat16),
               up_weight=T.randn((H, L), torch.bfloat16, 3, scale=L ** -0.5), **tr)


@pytest.mark.parametrize("run", [_finalize, _tail, _module], ids=["finalize", "tail", "module"])
def test_out_of_range_index_raises(run):
    rows = _triple(0)["expert_out"].shape[0]
    for bad in (rows, rows + 100, -2):
        with pytest.raises(ValueError, match="expanded_idx"):
            run(_triple(bad))
    out = run(_triple(-1))  # -1 skips the slot: valid
    assert not torch.isnan(out[0] if isinstance(out, tuple) else out).any()
