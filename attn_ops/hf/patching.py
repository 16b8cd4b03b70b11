"""``attn_ops.hf.patch``: HF modules whose computation the attention interface does not reach
-- MLA and Gated DeltaNet -- run on attn_ops' layers."""

from __future__ import annotations

import torch

from attn_ops.hf.common import _LAYERS_ATTR, _requests, _scratch_step, _slots, _where
from attn_ops.platforms import platform_of
from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec

_MLA_MODULES = ("DeepseekV3Attention",)
# HF's functions a Gated DeltaNet module's forward calls for its recurrence (fla's API:
# ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``), by their names in the
# module's file
_GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_GDN_ACTIVE = __import__("threading").local()  # (.layer: the patched module's recurrence)
_GDN_STEPS: dict = {}  # (the last steps' state metadata by shape: immutable, shared)


def patch(model, config: AttentionConfig | None = None) -> int:
    """Run ``model``'s MLA attention modules and Gated DeltaNet recurrences on attn_ops;
    returns how many modules were patched (again: none).

    * MLA (HF's ``DeepseekV3Attention``): on attn_ops' :class:`~attn_ops.MLAAttention` -- the
      absorbed form over a latent cache -- instead of HF's per-head expansion of every latent
      (what the attention interface would be handed). HF's projections, norms, RoPE and cache
      stay: each step takes the latents HF's cache holds (``cache.update`` on them, as HF's
      module does), copies each row's unpadded run into a latent cache of the step and runs
      the MLA layer's backend (the weights ``W_UK`` / ``W_UV`` split from ``kv_b_proj``).
      Needs the model loaded with ``attn_implementation="attn_ops"`` (after :func:`register`:
      its 2-D padding mask).
    * Gated DeltaNet (the ``*GatedDeltaNet`` modules of Qwen3-Next, Qwen3.5 and the other
      models whose files define HF's ``torch_chunk_gated_delta_rule``): the gated delta rule
      on the backend selected for the module's :class:`~attn_ops.backends.ssm.spec.
      GatedDeltaNetSpec` (``torch.ops.attn.gated_delta_rule``). HF's projections, conv, norm
      and cache stay; the two functions HF's forward calls for the recurrence (fla's API,
      through which HF itself swaps in fla's kernels) answer a patched module's calls with
      ours -- each batch row (or ``cu_seqlens`` run) a request, HF's state its initial state --
      and every other module's with HF's own."""
    from attn_ops.layers.mla import MLAAttention

    count = 0
    for module in model.modules():
        if _patch_gdn(module, config):
            count += 1
            continue
        if type(module).__name__ not in _MLA_MODULES or hasattr(module, "_attn_ops_mla"):
            continue
        spec = AttentionSpec.mla(
            module.num_heads, kv_lora_rank=module.kv_lora_rank,
            qk_nope_head_dim=module.qk_nope_head_dim, qk_rope_head_dim=module.qk_rope_head_dim,
            v_head_dim=module.v_head_dim, q_lora_rank=module.q_lora_rank,
            dtype=module.kv_b_proj.weight.dtype, scale=module.scaling)
        device = module.kv_b_proj.weight.device
        layer = MLAAttention(spec, config, platform=platform_of(device)).to(device)
        layer.load_kv_b_proj(module.kv_b_proj.weight.detach())
        module.__dict__["_attn_ops_mla"] = layer
        module.__dict__[_LAYERS_ATTR] = {spec: layer}
        module.forward = _mla_forward.__get__(module)
        count += 1
    return count


def _patch_gdn(module, config) -> bool:
    """Patch one Gated DeltaNet ``module`` (:func:`patch`); False where it is not one or is
    patched already."""
    import sys

    from attn_ops.backends.ssm.spec import GatedDeltaNetSpec
    from attn_ops.layers.ssm import StateLayer

    hf = sys.modules[type(module).__module__]
    if not type(module).__name__.endswith("GatedDeltaNet") or "_attn_ops_gdn" in \
            module.__dict__ or not all(hasattr(hf, name) for name in _GDN_FUNCTIONS):
        return False
    for name in _GDN_FUNCTIONS:  # (once a file: a dispatcher to ours or HF's own)
        if not getattr(getattr(hf, name), "_attn_ops_dispatch", False):
            setattr(hf, name, _gdn_dispatcher(getattr(hf, name), "chunk" in name))
    weight = module.out_proj.weight
    spec = GatedDeltaNetSpec(num_k_heads=module.num_k_heads, num_v_heads=module.num_v_heads,
                             head_k_dim=module.head_k_dim, head_v_dim=module.head_v_dim,
                             conv_kernel=module.conv_kernel_size, dtype=weight.dtype)
    layer = StateLayer(spec, config, platform=platform_of(weight.device)).to(weight.device)
    module.__dict__["_attn_ops_gdn"] = layer
    module.__dict__[_LAYERS_ATTR] = {spec: layer}
    module.forward = _gdn_forward.__get__(module)
    return True


def _gdn_forward(self, *args, **kwargs):
    """A patched Gated DeltaNet module's forward: HF's, its recurrence answered by ours."""
    outer = getattr(_GDN_ACTIVE, "layer", None)
    _GDN_ACTIVE.layer = self.__dict__["_attn_ops_gdn"]
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _GDN_ACTIVE.layer = outer


def _gdn_dispatcher(original, chunked: bool):
    """HF's ``original`` recurrence function (``chunked``: the one taking a ``chunk_size``
    after ``beta``), answered by the active patched module's backend (:func:`_gdn_recurrence`)
    inside that module's forward on this thread, by itself elsewhere."""
    import functools

    @functools.wraps(original)
    def call(query, key, value, g, beta, *args, **kwargs):
        layer = getattr(_GDN_ACTIVE, "layer", None)
        if layer is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args and chunked:
            args = args[1:]  # (its chunk_size: the backend's own)
        names = ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
        kwargs.update(zip(names, args))
        return _gdn_recurrence(layer, query, key, value, g, beta, **kwargs)

    call._attn_ops_dispatch = True
    return call


def _gdn_recurrence(layer, query, key, value, g, beta, initial_state=None,
                    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                    scale=None, chunk_size=None, **_):
    """fla's ``chunk_gated_delta_rule`` contract on ``layer``'s backend: ``query`` / ``key``
    ``[B, S, Hk, Dk]``, ``value`` ``[B, S, Hv, Dv]``, ``g`` / ``beta`` ``[B, S, Hv]``, each row a
    request (or, ``B == 1`` with ``cu_seqlens``, each of its runs), ``initial_state`` ``[N, Hv,
    Dk, Dv]`` -> ``(out [B, S, Hv, Dv], final state [N, Hv, Dk, Dv] fp32 or None)``."""
    from attn_ops.backends.ssm.metadata import build_state_metadata

    b, s, hk, dk = query.shape
    hv, dv = value.shape[2:]
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"attn_ops gated delta rule: cu_seqlens with a batch of {b} rows "
                             "(packed sequences come as one row)")
        qsl = [int(x) for x in cu_seqlens.tolist()]
    else:
        qsl = list(range(0, b * s + 1, s)) if s else [0] * (b + 1)
    n = len(qsl) - 1
    # (request i in slot i + 1: slot 0 is the null slot padding requests own)
    state = torch.zeros(n + 1, hv, dk, dv, dtype=layer.spec.state_dtype, device=query.device)
    if initial_state is not None:
        state[1:].copy_(initial_state.reshape(n, hv, dk, dv))
    shape = (tuple(qsl), initial_state is not None, layer.spec.chunk_size, str(query.device))
    meta = _GDN_STEPS.get(shape)
    if meta is None:  # (the same for every layer of a step, and for steps of the same shape)
        if len(_GDN_STEPS) >= 16:
            _GDN_STEPS.pop(next(iter(_GDN_STEPS), None), None)
        meta = _GDN_STEPS[shape] = build_state_metadata(
            qsl, [int(initial_state is not None)] * n, list(range(1, n + 1)),
            layer.spec.chunk_size, device=query.device)
    t = b * s
    dtype = query.dtype
    out = layer.impl.recurrence(
        query.reshape(t, hk, dk), key.reshape(t, hk, dk), value.reshape(t, hv, dv).to(dtype),
        g.reshape(t, hv), beta.reshape(t, hv), state, meta,
        scale if scale is not None else dk ** -0.5, bool(use_qk_l2norm_in_kernel))
    return out.reshape(b, s, hv, dv).to(dtype), (state[1:] if output_final_state else None)


def _mla_forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                 past_key_values=None, **kwargs):
    """A patched ``DeepseekV3Attention.forward`` (:func:`patch`)."""
    import sys

    from attn_ops.backends.mla.common import mla_cache_update

    hf = sys.modules[type(self).__module__]
    cache = cache if cache is not None else past_key_values
    b, s = hidden_states.shape[:2]
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(b, s, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    latent = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(latent, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, s, self.kv_lora_rank)
    k_rot = k_rot.view(b, 1, s, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    rotate = hf.apply_rotary_pos_emb_interleave if self.config.rope_interleave \
        else hf.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    if getattr(cache, "attn_ops_owned", False):
        raise ValueError(f"attn_ops.hf.patch ({_where(self)}) runs over HF's own caches: "
                         "pass none of attn_ops.hf.cache's to a patched model")
    if cache is not None:  # (HF's cache keeps the latents; the history comes back with them)
        kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
    layer = self.__dict__["_attn_ops_mla"]
    q = torch.cat((q_pass, q_rot), dim=-1)  # [B, H, S, nope + rope]
    skv = kv_nope.shape[2]
    rows = _requests(attention_mask, b, s, skv, self)
    live = [r for r, (s0, q0, e) in enumerate(rows) if e > q0]
    out = q.new_zeros(b, s, self.num_heads, self.v_head_dim)
    if live:
        shift = s - skv
        steps, pages, meta = _scratch_step(
            layer.block_size, [rows[r][2] - rows[r][0] for r in live],
            [rows[r][2] - rows[r][1] for r in live], q.device)
        order = [live[i] for i in steps]
        latents = layer.allocate_cache(pages.blocks, q.device)
        history = [rows[r][1] - rows[r][0] for r in live]
        if any(history):  # (the history, then the step writes its tokens)
            mla_cache_update(
                torch.cat([kv_nope[r, 0, rows[r][0]:rows[r][1]] for r in order]).contiguous(),
                torch.cat([k_rot[r, 0, rows[r][0]:rows[r][1]] for r in order]).contiguous(),
                latents, _slots(pages, steps, history, q.device), layer.kv_scale)
        new = lambda t: torch.cat([t[r, :, rows[r][1] + shift:rows[r][2] + shift].transpose(  # noqa
            0, 1) for r in order]).contiguous()
        got = layer(new(q), torch.cat([kv_nope[r, 0, rows[r][1]:rows[r][2]] for r in order]),
                    torch.cat([k_rot[r, 0, rows[r][1]:rows[r][2]] for r in order]), latents, meta)
        at = 0
        for r in order:
            n = rows[r][2] - rows[r][1]
            out[r, rows[r][1] + shift:rows[r][2] + shift] = got[at:at + n]
            at += n
    return self.o_proj(out.reshape(b, s, -1)), None
