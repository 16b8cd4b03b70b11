"""``MLAIndexer``: DeepSeek-V3.2's lightning indexer as a module -- its projections, the index
keys into their cache (``torch.ops.attn.indexer_k_write``) and each query token's top-k cached
positions (``torch.ops.attn.indexer_topk``) as global slots for the sparse attention
(``torch.ops.attn.indexer_slots``).

``q = wq_b(q_resid)`` per index head and ``k = LayerNorm(wk(x))`` (one key a token), both with
half-split (NeoX) RoPE on their first ``rope_dim`` channels -- not the interleaved RoPE of the
attention's own rope part -- and head weights ``weights_proj(x) * H^-0.5 * dim^-0.5`` (the
``dim^-0.5`` of the dot products, moved out of the ReLU since it is positive).
"""

from __future__ import annotations

import torch
from torch import nn

from attn_ops.backends.mla.indexer import (FP8, allocate_index_cache, indexer_k_write,
                                           indexer_slots, indexer_topk)

__all__ = ["MLAIndexer"]


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on ``x [..., rope]`` with ``cos`` / ``sin`` ``[..., rope]`` (each
    frequency twice, as HF's rotary embeddings give them)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class MLAIndexer(nn.Module):
    """The indexer of one sparse MLA layer: ``hidden_size`` inputs, ``q_lora_rank`` query
    latents, ``num_heads`` index heads of ``head_dim`` (RoPE on the first ``rope_dim``),
    ``topk`` positions a query token.

    ``forward(x, q_resid, cos, sin, keys, scales, slot_mapping, block_table, seq_lens,
    query_start_loc)`` writes the step's index keys and returns ``(positions, slots)``, both
    ``[T, topk]`` int32 with -1 padding: request-local positions and their cache slots."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int = 64,
                 head_dim: int = 128, rope_dim: int = 64, topk: int = 2048) -> None:
        super().__init__()
        if rope_dim > head_dim or rope_dim % 2:
            raise ValueError(f"rope_dim={rope_dim} must be even and at most head_dim={head_dim}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.rope_dim, self.topk = rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def allocate_cache(self, num_blocks: int, page: int, dtype: torch.dtype = FP8,
                       scale_block: int | None = None, device: torch.device | str = "cpu"):
        """``(keys, scales)`` for this layer (:func:`allocate_index_cache`)."""
        return allocate_index_cache(num_blocks, page, self.head_dim, dtype, scale_block, device)

    def project(self, x, q_resid, cos, sin):
        """``(q [T, H, dim], k [T, dim], weights [T, H])`` of the step's tokens."""
        t, r = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        q = torch.cat([_rope_half(q[..., :r], cos[:, None], sin[:, None]), q[..., r:]], dim=-1)
        k = torch.cat([_rope_half(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        w = self.weights_proj(x).float() * (self.num_heads ** -0.5 * self.head_dim ** -0.5)
        return q, k, w

    def forward(self, x, q_resid, cos, sin, keys, scales, slot_mapping, block_table, seq_lens,
                query_start_loc, block_size: int | None = None):
        """``block_size``: the page size of the block table (the attention layer's); the
        index-key cache must have it -- its slots and the latent cache's are the same."""
        if block_size is not None and keys.shape[1] != block_size:
            raise ValueError(
                f"the index-key cache has pages of {keys.shape[1]} tokens, the block table "
                f"{block_size}: the indexer's slots address the latent cache through the same "
                f"table, so allocate it with MLAIndexer.allocate_cache(num_blocks, "
                f"{block_size}) (the attention layer's block_size)")
        q, k, w = self.project(x, q_resid, cos, sin)
        indexer_k_write(k, keys, scales, slot_mapping)
        positions = indexer_topk(q, w, keys, scales, block_table, seq_lens, query_start_loc,
                                 self.topk)
        return positions, indexer_slots(positions, block_table, query_start_loc, keys.shape[1],
                                        seq_lens)
