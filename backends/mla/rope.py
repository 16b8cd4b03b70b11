"""RoPE of an MLA layer's rope parts, and its fused form with the latent-cache write.

* ``torch.ops.attn.mla_rope(q [T, H, nope + rope], k_pe [T, rope], cos_sin [T, rope]) ->
  (q, k_pe)``: rotate-half RoPE (:func:`attn_ops.glue.rope`) of each query head's last
  ``rope`` dims (the first ``nope`` pass through) and of ``k_pe``. Interleaved RoPE (DeepSeek-V3's
  ``rope_interleave``) is this on dims permuted to ``[0, 2, 4, ..., 1, 3, 5, ...]``, which a
  model folds into the ``q_b_proj`` / ``kv_a_proj`` rows once.
* ``torch.ops.attn.mla_rope_cache_update(q, kv_c, k_pe, cos_sin, latent_cache, slot_mapping,
  scale) -> (q, k_pe)``: both of the above and
  :data:`~attn_ops.backends.mla.common.mla_cache_update` of ``[kv_c | rotated k_pe]`` in one
  op -- on the GPU one Triton launch (the KV write's kernel,
  :func:`attn_ops.glue_kernels.rope_write_paged`, page tails cleared in it). The MLA RoPE pass
  (:mod:`attn_ops.compile_passes.mla_rope_fusion`) folds a layer's ``mla_rope`` and cache write
  into it.

``cos_sin`` is ``[cos | sin]`` per token as the model computes it, used as given (nothing here
derives it from a base): a scaled RoPE -- YaRN's frequencies and its factor on cos and sin, so
``cos ** 2 + sin ** 2`` need not be 1 -- reaches the eager, fused and GPU-kernel paths alike
through it (:func:`attn_ops.models.deepseek.mla_rope_cache` builds DeepSeek's).
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.common import _check_update, _mla_cache_update
from attn_ops.glue import _rope_impl
from attn_ops.ops import define_op

__all__ = ["mla_rope", "mla_rope_cache_update"]


def _check_rope(q, k_pe, cos_sin) -> None:
    if q.dim() != 3 or k_pe.dim() != 2 or k_pe.shape[0] != q.shape[0]:
        raise ValueError(f"mla_rope: q must be [num_tokens, heads, nope + rope] and k_pe "
                         f"[num_tokens, rope], got {tuple(q.shape)} and {tuple(k_pe.shape)}")
    rope = k_pe.shape[1]
    if rope % 2 or rope > q.shape[2]:
        raise ValueError(f"mla_rope: the rope width {rope} (k_pe's) must be even and at most "
                         f"q's head dim {q.shape[2]}")
    if tuple(cos_sin.shape) != (q.shape[0], rope):
        raise ValueError(f"mla_rope: cos_sin must be [num_tokens={q.shape[0]}, rope={rope}] "
                         f"(cos | sin halves), got {tuple(cos_sin.shape)}")


def _mla_rope_impl(q, k_pe, cos_sin):
    _check_rope(q, k_pe, cos_sin)
    nope = q.shape[2] - k_pe.shape[1]
    q_rot = torch.cat([q[..., :nope], _rope_impl(q[..., nope:], cos_sin)], dim=-1)
    return q_rot, _rope_impl(k_pe[:, None], cos_sin)[:, 0]


def _mla_rope_fake(q, k_pe, cos_sin):
    _check_rope(q, k_pe, cos_sin)
    return torch.empty_like(q), torch.empty_like(k_pe)


mla_rope = define_op("mla_rope", "(Tensor q, Tensor k_pe, Tensor cos_sin) -> (Tensor, Tensor)",
                     _mla_rope_impl, _mla_rope_fake)


def _fused_impl(q, kv_c, k_pe, cos_sin, latent_cache, slot_mapping, scale):
    _check_rope(q, k_pe, cos_sin)
    ds = _check_update(kv_c, k_pe, latent_cache, slot_mapping, scale)
    if q.is_cuda and not ds:
        # one launch: rotate, write [kv_c | k_pe], clear entered pages' tails
        from attn_ops.glue_kernels import rope_write_paged

        rank = kv_c.shape[1]
        q_rot, k_rot = rope_write_paged(
            q, k_pe[:, None], kv_c[:, None], cos_sin, latent_cache[:, :, None, rank:],
            latent_cache[:, :, None, :rank], slot_mapping, None, None, None, scale, scale,
            nope=q.shape[2] - k_pe.shape[1], key_out=True)
        return q_rot, k_rot[:, 0]
    q_rot, k_rot = _mla_rope_impl(q, k_pe, cos_sin)
    _mla_cache_update(kv_c, k_rot, latent_cache, slot_mapping, scale)
    return q_rot, k_rot


def _fused_fake(q, kv_c, k_pe, cos_sin, latent_cache, slot_mapping, scale):
    _check_rope(q, k_pe, cos_sin)
    _check_update(kv_c, k_pe, latent_cache, slot_mapping, scale)
    return torch.empty_like(q), torch.empty_like(k_pe)


mla_rope_cache_update = define_op(
    "mla_rope_cache_update",
    "(Tensor q, Tensor kv_c, Tensor k_pe, Tensor cos_sin, Tensor(a!) latent_cache, "
    "Tensor slot_mapping, Tensor? scale) -> (Tensor, Tensor)",
    _fused_impl, _fused_fake)
