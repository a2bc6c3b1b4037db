"""The tiers' bodies, written once against :class:`k3tail.collectives.Collectives` (DESIGN §2, §3.4).

``TierPaths`` is mixed into :class:`k3tail.module.K3MoETail`; it uses the module's ``config``,
``rank``, ``world_size``, ``coll`` (the collectives), ``bounds_latent`` / ``bounds_hidden`` (the
column shards, ``k3tail.ops.prefill.shard_bounds``) and the allocated tier objects.  Every path forms
the latent with the same bits: the routed partial is the exact-product fp32 finalize
(``k3tail.ops.prefill.finalize_to_shards``, the twin of ``numerics.routed_partial``), the sum over
ranks is rank-order fp64 (or an fp64 all-reduce, order-free) rounded once to fp32, the RMS
statistic is fp64, the normed latent is rounded once; the output ``prefix + normed @ W^T +
shared_sum`` is rounded once (``k3tail.ops.projection.project``).

The large-M path (:meth:`TierPaths._large_m_sharded`, issue 14): finalize straight into the send
layout, exchange the column shards (routed fp32, shared in its 16-bit dtype), sum the own shard
in rank order with its fp64 sum of squares, all-gather the ``[M, W]`` statistics, normalize the
own latent shard, all-gather the normed latent, project the own output columns, all-gather them.
Per rank and layer it moves the bytes of a reduce-scatter plus three all-gathers
(``k3tail.tools.traffic``), with no fp64 on the wire.  Its peer-kind call sequence is four phases
(write routed + shared | B1 | reduce, write stats | B2 | gather stats, write normed | B3 | gather
normed, write out | B4 | gather out): every area is rewritten only after a barrier that its
readers enter after reading it (``k3tail.ops.exchange.PeerExchange``'s rule; no trailing barrier).
"""

from __future__ import annotations

import torch

from k3tail import numerics
from k3tail.errors import TierUnavailable
from k3tail.ops.prefill import finalize_to_shards, normalize_shard
from k3tail.ops.projection import project


class TierPaths:
    """The tier bodies of K3MoETail (see the module docstring)."""

    # -- shared pieces (fp32 throughout, one rounding per output) --------------------
    def _routed_partial(self, routed, expert_out, expert_weights, expanded_idx) -> torch.Tensor:
        """This rank's routed partial ``[M, L]`` fp32 (Triton finalize, ``numerics.routed_partial``'s bits)."""
        c = self.config
        M = (routed if routed is not None else expanded_idx).shape[0]
        flat = finalize_to_shards(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                                  expanded_idx=expanded_idx, scale=c.routed_scale, bounds=[0, c.latent])
        return flat.view(M, c.latent)

    def _rmsnorm(self, s: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        return numerics.rms_normalize(s, norm_weight, self.config.eps, self.config.dtype)

    def _own_cols(self) -> slice:
        b = self.bounds_hidden
        return slice(b[self.rank], b[self.rank + 1])

    def _own_rows(self, up_weight):
        return up_weight if self.config.shard_up_proj else up_weight[self._own_cols()]

    def _finish(self, normed, shared_sum, prefix, up_weight) -> torch.Tensor:
        """``prefix + normed @ W_up^T + shared_sum``, rounded once (own columns + gather, or full)."""
        c = self.config
        if not c.shard_up_proj:
            return project(normed, up_weight, prefix=prefix, shared_sum=shared_sum, out_dtype=c.dtype,
                           tactics=self._proj_tactics)
        cols = self._own_cols()
        y = project(normed, up_weight, prefix=prefix[:, cols], shared_sum=shared_sum[:, cols], out_dtype=c.dtype,
                    tactics=self._proj_tactics)
        return self.coll.all_gather_cols(y, self.bounds_hidden)

    # -- the tiers ----------------------------------------------------------------------
    def _tier_separate(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                       expanded_idx):
        """The reference: fp64 all-reduce of the routed partial, fp32 of the shared, norm, projection."""
        coll, side = self.coll, self._side_stream

        def routed_branch():
            s = coll.all_reduce_sum(self._routed_partial(routed, expert_out, expert_weights, expanded_idx),
                                    fp64=True)
            return self._rmsnorm(s, norm_weight)

        if side is not None:  # CUDA process groups: the routed branch overlaps the shared branch
            cur = torch.cuda.current_stream(self.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                normed = routed_branch()
            shared_sum = coll.all_reduce_sum(shared, fp64=False)
            cur.wait_stream(side)
            normed.record_stream(cur)
        else:
            normed = routed_branch()
            shared_sum = coll.all_reduce_sum(shared, fp64=False)
        return self._finish(normed, shared_sum, prefix, up_weight)

    def _tier_lane(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx):
        """The Lamport lane up to its capacity; above it the sharded large-M path (or, with
        ``large_m="allreduce"``, the fp64 all-reduce of the whole lane, the path before it)."""
        args = dict(routed=routed, expert_out=expert_out, expert_weights=expert_weights, expanded_idx=expanded_idx)
        M = prefix.shape[0]
        if self._lane is not None and M <= self.caps.lane_max_tokens:
            normed, shared_sum = self._lane(norm_weight=norm_weight, shared=shared, **args)
            return self._finish(normed, shared_sum, prefix, up_weight)
        if self.large_m == "sharded":
            return self._large_m_sharded(prefix=prefix, shared=shared, norm_weight=norm_weight,
                                         up_weight=up_weight, **args)
        s, shared_sum = self.coll.all_reduce_sums([self._routed_partial(**args), shared], fp64=True)
        return self._finish(self._rmsnorm(s, norm_weight), shared_sum, prefix, up_weight)

    def _large_m_sharded(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                         expanded_idx):
        """The sharded large-M path (module docstring): fp32 sums, no fp64 on the wire."""
        c, X, r, W = self.config, self.coll.exchange, self.rank, self.world_size
        bl, bh = self.bounds_latent, self.bounds_hidden
        M, dt = prefix.shape[0], c.dtype
        l0, l1, h0, h1 = bl[r], bl[r + 1], bh[r], bh[r + 1]
        # 1. finalize (and pack the shared partial) straight into the send layouts
        finalize_to_shards(routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                           expanded_idx=expanded_idx, scale=c.routed_scale, bounds=bl,
                           out=X.area("routed", torch.float32, M * c.latent))
        X.put("shared", shared, bh)
        X.publish()
        # 2-3. the own shards, summed in rank order; the own shard's fp64 sum of squares
        x32, ss = X.reduce_shards("routed", M=M, bounds=bl, dtype=torch.float32, sumsq=True)
        shared_sum, _ = X.reduce_shards("shared", M=M, bounds=bh, dtype=dt, sumsq=False)
        X.put("stats", ss.view(M, 1))
        X.publish()
        stats = X.gather("stats", M=M, bounds=list(range(W + 1)), dtype=torch.float64)
        normalize_shard(x32, stats, norm_weight[l0:l1], eps=c.eps, width=c.latent, dtype=dt,
                        out=X.area("normed", dt, M * (l1 - l0)).view(M, l1 - l0))
        X.publish()
        # 4. the normed latent, then 5. the own output columns
        normed = X.gather("normed", M=M, bounds=bl, dtype=dt)
        project(normed, self._own_rows(up_weight), prefix=prefix[:, h0:h1], shared_sum=shared_sum, out_dtype=dt,
                tactics=self._proj_tactics, out=X.area("out", dt, M * (h1 - h0)).view(M, h1 - h0))
        X.publish()
        out = X.gather("out", M=M, bounds=bh, dtype=dt)
        X.end_call()
        return out

    def _tier_tail(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx):
        return self._tail(prefix=prefix, shared=shared, norm_weight=norm_weight, up_weight=self._own_rows(up_weight),
                          routed=routed, expert_out=expert_out, expert_weights=expert_weights,
                          expanded_idx=expanded_idx)

    def _tier_multimem(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                       expanded_idx):
        p = self._routed_partial(routed, expert_out, expert_weights, expanded_idx)
        s, shared_sum = self._mm(p, shared)
        return self._finish(self._rmsnorm(s, norm_weight), shared_sum, prefix, up_weight)

    def _tier_cute(self, *, prefix, shared, norm_weight, up_weight, routed, expert_out, expert_weights,
                   expanded_idx):
        """UNVERIFIED on hardware (no SM100 here): flashinfer stage 1, projection shard injected
        into the fp32 shared partial, one fp32 all-reduce, prefix, one rounding."""
        if routed is not None:
            raise TierUnavailable("CUTE_FINALIZE takes the deferred triple (expert_out, expert_weights, "
                                  "expanded_idx), not a materialized routed tensor")
        normed = self._cute(norm_weight=norm_weight, expert_out=expert_out, expert_weights=expert_weights,
                            expanded_idx=expanded_idx)
        cols = self._own_cols()
        partial = shared.float()
        partial[:, cols] = project(normed, self._own_rows(up_weight), shared_sum=partial[:, cols].contiguous(),
                                   out_dtype=torch.float32, tactics=self._proj_tactics)
        total = self.coll.all_reduce_sum(partial, fp64=False)
        return (prefix.float() + total).to(self.config.dtype)
