"""Megatron-core's token permutation, as its alltoall dispatcher runs it without fused kernels
or Transformer Engine: the NCCL baselines of the normal path are built on these."""

from __future__ import annotations

import torch


def moe_ops():
    """(label, permute, unpermute, sort_chunks): megatron-core's own moe_utils functions on
    their non-fused path when megatron-core imports, else a copy of 0.16.1's non-fused code."""
    try:
        import megatron.core as mc
        from megatron.core.transformer.moe import moe_utils as mu

        def permute(tokens, routing_map, probs, num_out):
            out = mu.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out, fused=False)
            return out[0], out[1], out[2]  # 0.16: 3 values, later: 5

        def unpermute(rows, sorted_indices, shape):
            return mu.unpermute(rows, sorted_indices, restore_shape=shape, fused=False)

        def sort_chunks(rows, split_sizes, sorted_idxs, probs=None):
            return mu.sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs=probs, fused=False)

        return f"megatron-core {mc.__version__} moe_utils, non-fused", permute, unpermute, sort_chunks
    except Exception as exc:  # noqa: BLE001  (not installed, or broken without its extras)
        why = f"{type(exc).__name__}"

    def permute(tokens, routing_map, probs, num_out):  # moe_utils.permute, dropless, non-fused
        num_tokens, num_experts = tokens.shape[0], routing_map.shape[1]
        routing_map = routing_map.bool().T.contiguous()
        token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
        sorted_indices = token_indices.masked_select(routing_map)
        permuted_probs = probs.T.contiguous().masked_select(routing_map) if probs is not None else None
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices

    def unpermute(rows, sorted_indices, shape):  # moe_utils.unpermute, no probs, non-deterministic mode
        out = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, shape[1]), rows)
        return out

    def sort_chunks(rows, split_sizes, sorted_idxs, probs=None):  # moe_utils.sort_chunks_by_idxs
        parts = torch.split(rows, split_sizes.tolist(), dim=0)
        out = torch.cat([parts[i] for i in sorted_idxs.tolist()], dim=0)
        if probs is not None:
            pparts = torch.split(probs, split_sizes.tolist(), dim=0)
            probs = torch.cat([pparts[i] for i in sorted_idxs.tolist()], dim=0)
        return out, probs

    return f"copy of megatron-core 0.16.1 moe_utils, non-fused (megatron-core: {why})", permute, unpermute, sort_chunks
