"""What a model calls: one module a layer kind.

* :mod:`~attn_ops.layers.attention` -- :class:`Attention` (standard attention over the paged
  cache), the base every backend-running layer shares, and :func:`build_step_metadata`;
* :mod:`~attn_ops.layers.mla` -- :class:`MLAAttention` (DeepSeek's latent attention, dense and
  sparse); :mod:`~attn_ops.layers.mla_indexer` -- :class:`MLAIndexer` (DeepSeek-V3.2's top-k);
* :mod:`~attn_ops.layers.ssm` -- the recurrent-state layers (Gated DeltaNet, Mamba2, short
  convolution).

Nothing is imported here: ``attn_ops.Attention`` and ``attn_ops.MLAAttention`` load their module
on first use.
"""
