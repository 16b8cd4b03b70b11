"""Real-peer check: our ``Attention`` layer against Hugging Face transformers' own attention
modules (``LlamaAttention`` with GQA, ``MistralAttention`` with a sliding window,
``Gemma2Attention`` with logits soft-capping, ``query_pre_attn_scalar`` and its sliding layer).

Both sides share the HF module's projections and HF's own rotary embedding
(``<Model>RotaryEmbedding`` + ``apply_rotary_pos_emb`` of that model's modeling file). HF runs
its ``eager`` attention with the 4-D additive mask from ``transformers.masking_utils`` (the
function its ``<Model>Model`` picks for that layer type), one sequence at a time; we run the
packed batch through our paged cache (small shuffled pages, so block tables are
non-contiguous), then the module's ``o_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Gemma2Config, LlamaConfig, MistralConfig  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    create_causal_mask, create_sliding_window_causal_mask)
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402

from attn_ops import (  # noqa: E402
    Attention, AttentionConfig, AttentionSpec, Backend, BlockAllocator, build_batch,
    get_backend_class)

BLOCK_SIZE = 4
NUM_BLOCKS = 48
BACKENDS = [Backend.REFERENCE, Backend.CPU_ATTN]
DTYPES = [torch.float32, torch.float64]
# Every backend in every dtype it declares (CPU_ATTN computes fp32/fp16/bf16, not fp64).
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{str(d)[6:]}") for b in BACKENDS for d in DTYPES
                  if d in get_backend_class(b).capabilities.dtypes]
# HF's eager attention takes its softmax in float32 even for float64 inputs, so float64 agrees
# to ~1e-7, not to float64 round-off.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-6, rtol=1e-6)}
# Hidden states are scaled up so attention scores are O(several units): the soft-cap then
# really bends them and the softmax is far from uniform, so the window really matters.
INPUT_STD = 3.0


@dataclass(frozen=True)
class Case:
    name: str
    modeling: object  # the transformers modeling module
    attention_cls: str
    rope_cls: str
    config_cls: type
    config_kwargs: dict
    layer_idx: int = 0

    def config(self, dtype: torch.dtype):
        return self.config_cls(**self.config_kwargs, dtype=dtype, attn_implementation="eager")


CASES = [
    Case("llama_gqa", modeling_llama, "LlamaAttention", "LlamaRotaryEmbedding", LlamaConfig,
         dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=1, attention_bias=True)),
    Case("mistral_swa", modeling_mistral, "MistralAttention", "MistralRotaryEmbedding",
         MistralConfig,
         dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
              num_hidden_layers=1, sliding_window=5)),
    *[Case(f"gemma2_softcap_{kind}", modeling_gemma2, "Gemma2Attention",
           "Gemma2RotaryEmbedding", Gemma2Config,
           dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=2.0),
           layer_idx=layer)
      for kind, layer in (("full", 1), ("sliding", 0))],
]
CASE_IDS = [c.name for c in CASES]


class Peer:
    """One HF attention module (seeded weights), its rotary embedding and the matching spec."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int = 0) -> None:
        self.case, self.dtype = case, dtype
        self.config = config = case.config(dtype)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.attn = getattr(case.modeling, case.attention_cls)(config, case.layer_idx)
        self.attn = self.attn.to(dtype).eval()
        self.rope = getattr(case.modeling, case.rope_cls)(config)
        self.apply_rope = case.modeling.apply_rotary_pos_emb
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.attn.head_dim
        # The window and soft-cap exactly as the HF module applies them.
        if case.modeling is modeling_gemma2:
            self.sliding_window = self.attn.sliding_window
            self.soft_cap = self.attn.attn_logit_softcapping
            sliding_layer = config.layer_types[case.layer_idx] == "sliding_attention"
        else:
            self.sliding_window = getattr(config, "sliding_window", None)
            self.soft_cap = None
            sliding_layer = self.sliding_window is not None
        self.mask_fn = create_sliding_window_causal_mask if sliding_layer else create_causal_mask
        self.scale = self.attn.scaling

    def spec(self, **overrides) -> AttentionSpec:
        kwargs = dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, dtype=self.dtype, block_size=BLOCK_SIZE,
                      sliding_window=self.sliding_window, logits_soft_cap=self.soft_cap,
                      scale=self.scale)
        kwargs.update(overrides)
        return AttentionSpec(**kwargs)

    def hidden(self, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(length, self.config.hidden_size, generator=g,
                            dtype=torch.float64) * INPUT_STD).to(self.dtype)

    @torch.no_grad()
    def hf_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """HF's own forward of one whole sequence ``[S, hidden]`` -> ``[S, hidden]``."""
        x = hidden[None]
        pos = torch.arange(hidden.shape[0])[None]
        cos, sin = self.rope(x, pos)
        import inspect

        # (the cache argument's name: ``cache`` from transformers 5.2x, ``past_key_values``
        # before)
        cache = "cache" if "cache" in inspect.signature(self.mask_fn).parameters \
            else "past_key_values"
        mask = self.mask_fn(config=self.config, inputs_embeds=x, attention_mask=None,
                            position_ids=pos, **{cache: None})
        out, _ = self.attn(x, position_embeddings=(cos, sin), attention_mask=mask)
        return out[0]

    @torch.no_grad()
    def qkv(self, hidden: torch.Tensor, positions: torch.Tensor):
        """The module's projections + HF's rotary embedding for packed tokens ``[T, hidden]``."""
        t = hidden.shape[0]
        q = self.attn.q_proj(hidden).view(t, self.num_heads, self.head_dim)
        k = self.attn.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.attn.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = self.rope(hidden[None], positions[None])
        q, k = self.apply_rope(q, k, cos[0], sin[0], unsqueeze_dim=1)  # cos [T, 1, D]
        return q, k, v

    @torch.no_grad()
    def ours(self, layer: Attention, cache, allocator, hidden: torch.Tensor, request_ids,
             context_lens, query_lens) -> torch.Tensor:
        """One step of our layer (+ ``o_proj``) over packed ``hidden`` ``[T, hidden]``."""
        md = build_batch(allocator, request_ids, context_lens, query_lens)
        q, k, v = self.qkv(hidden, md.positions)
        out = layer(q, k, v, cache, md)
        assert out.dtype == self.dtype
        return self.attn.o_proj(out.reshape(hidden.shape[0], -1))


def make_layer(peer: Peer, backend, **spec_overrides):
    layer = Attention(peer.spec(**spec_overrides), AttentionConfig(backend=backend))
    assert layer.backend == str(backend)
    assert layer.block_size == BLOCK_SIZE
    cache = layer.allocate_kv_cache(NUM_BLOCKS)
    allocator = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, shuffle=True, seed=1)
    return layer, cache, allocator


def assert_non_contiguous(allocator, request_id):
    blocks = allocator.blocks(request_id)
    assert len(blocks) >= 2
    assert any(b + 1 != c for b, c in zip(blocks, blocks[1:])), blocks


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill_matches_hf(case, backend, dtype):
    peer = Peer(case, dtype)
    lens = [13, 9]
    hidden = [peer.hidden(n, seed=10 + i) for i, n in enumerate(lens)]
    expected = torch.cat([peer.hf_forward(h) for h in hidden])

    layer, cache, allocator = make_layer(peer, backend)
    got = peer.ours(layer, cache, allocator, torch.cat(hidden), ["a", "b"], [0, 0], lens)
    assert_non_contiguous(allocator, "a")
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_matches_hf(case, backend, dtype):
    """Prefill two requests of different lengths, then decode both together, one token per
    request per step, crossing page boundaries; each decode output must equal HF's output at
    the last position of the whole sequence so far."""
    peer = Peer(case, dtype)
    prompt, steps = [11, 6], 3
    full = [peer.hidden(n + steps, seed=20 + i) for i, n in enumerate(prompt)]
    ids = ["a", "b"]
    layer, cache, allocator = make_layer(peer, backend)

    got = peer.ours(layer, cache, allocator, torch.cat([h[:n] for h, n in zip(full, prompt)]),
                    ids, [0, 0], prompt)
    expected = torch.cat([peer.hf_forward(h[:n]) for h, n in zip(full, prompt)])
    torch.testing.assert_close(got, expected, **TOL[dtype])

    for step in range(steps):
        ctx = [n + step for n in prompt]
        new = torch.cat([h[c:c + 1] for h, c in zip(full, ctx)])
        got = peer.ours(layer, cache, allocator, new, ids, ctx, [1, 1])
        expected = torch.stack([peer.hf_forward(h[:c + 1])[-1] for h, c in zip(full, ctx)])
        torch.testing.assert_close(got, expected, **TOL[dtype],
                                   msg=lambda m, step=step: f"step {step}: {m}")
    assert_non_contiguous(allocator, "a")
    assert_non_contiguous(allocator, "b")


def _sensitivity_cases():
    """(case, spec change that a wrong implementation might make) pairs."""
    out = [(c, dict(scale=None), "scale") for c in CASES if c.modeling is modeling_gemma2]
    out += [(c, dict(sliding_window=None), "window") for c in CASES
            if c.name in ("mistral_swa", "gemma2_softcap_sliding")]
    out += [(c, dict(sliding_window=c.config_kwargs["sliding_window"] + 1), "window+1")
            for c in CASES if c.name in ("mistral_swa", "gemma2_softcap_sliding")]
    out += [(c, dict(logits_soft_cap=None), "softcap") for c in CASES
            if c.modeling is modeling_gemma2]
    out += [(CASES[0], dict(num_kv_heads=None), "mha")]
    return out


@pytest.mark.parametrize("case,change,_name", _sensitivity_cases(),
                         ids=[f"{c.name}-{n}" for c, _, n in _sensitivity_cases()])
def test_peer_comparison_is_sensitive(case, change, _name):
    """The configs above exercise each feature: getting the window (even off by one), the
    soft-cap or the Gemma 2 scale wrong changes the prefill output far beyond the tolerance."""
    peer = Peer(case, torch.float64)
    lens = [13, 9]
    hidden = [peer.hidden(n, seed=10 + i) for i, n in enumerate(lens)]
    expected = torch.cat([peer.hf_forward(h) for h in hidden])
    if "num_kv_heads" in change:
        # MHA over GQA weights: repeat each KV head's projection so the shapes fit, but pair
        # query heads with KV heads in the wrong (interleaved instead of grouped) order.
        group = peer.num_heads // peer.num_kv_heads
        with torch.no_grad():
            for proj in (peer.attn.k_proj, peer.attn.v_proj):
                w = proj.weight.view(peer.num_kv_heads, peer.head_dim, -1)
                new = torch.nn.Linear(w.shape[-1], peer.num_heads * peer.head_dim,
                                      bias=proj.bias is not None).to(peer.dtype)
                new.weight.copy_(w.repeat(group, 1, 1).reshape(-1, w.shape[-1]))
                if proj.bias is not None:
                    new.bias.copy_(proj.bias.view(peer.num_kv_heads, -1).repeat(group, 1)
                                   .reshape(-1))
                setattr(peer.attn, "k_proj" if proj is peer.attn.k_proj else "v_proj", new)
        peer.num_kv_heads = peer.num_heads
    layer, cache, allocator = make_layer(peer, Backend.REFERENCE, **change)
    got = peer.ours(layer, cache, allocator, torch.cat(hidden), ["a", "b"], [0, 0], lens)
    assert max_err(got, expected) > 1e-2
