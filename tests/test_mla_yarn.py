"""YaRN RoPE scaling (every released DeepSeek-V2/V3 config's ``rope_scaling``) in TinyDeepseek,
against HF transformers' ``DeepseekV3ForCausalLM`` with the same weights: its frequencies,
its factor on cos/sin and its softmax scale (``mscale_all_dim``), through
:func:`attn_ops.models.deepseek.load_hf_deepseek`.

The configs pretrain at 32 positions (``original_max_position_embeddings``) and run sequences
past it, so the interpolated frequencies matter; ``qk_rope_head_dim`` 16 with the given bases
puts some dims on the ramp between ``beta_fast`` and ``beta_slow`` (blended frequencies), some
below it and some above.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attn_ops import AttentionConfig, BlockAllocator, build_batch  # noqa: E402
from attn_ops.models.deepseek import (MLAModelConfig, TinyDeepseek, YarnScaling,  # noqa: E402
                                hf_rope_config, load_hf_deepseek)
from attn_ops.platforms import current_platform  # noqa: E402

NUM_BLOCKS = 64
DEVICE = current_platform().device_type  # (HF on the host, ours on this machine's device)
TOL = dict(atol=2e-4, rtol=2e-4)
VOCAB = 96

# the released DeepSeek-V3 values, except the pretraining length (4096 there); legacy key
DEEPSEEK_V3 = dict(rope_scaling={
    "type": "yarn", "factor": 40, "original_max_position_embeddings": 32, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
# mscale != mscale_all_dim: cos and sin get a factor != 1 (1.053 here); another base
MSCALE_RATIO = dict(rope_parameters={
    "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707,
    "rope_theta": 500.0})
CASES = {"deepseek_v3": DEEPSEEK_V3, "mscale_ratio": MSCALE_RATIO}


def _hf_config(rope: dict, q_lora_rank=24, **overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=12,
        first_k_dense_replace=2, rope_interleave=True, max_position_embeddings=128,
        attn_implementation="eager", dtype=torch.float32,
        # weights 5x HF's default init: logits O(3) and attention far from uniform, so plain
        # RoPE misses HF's logits by O(1), not by 1e-3
        initializer_range=0.1)
    kwargs.update(overrides)
    return transformers.DeepseekV3Config(**kwargs, **{k: dict(v) for k, v in rope.items()})


def _pair(rope: dict, q_lora_rank=24, backend="REFERENCE_MLA"):
    """(HF's model, ours with its weights): seeded, eval, ours on DEVICE."""
    hf_cfg = _hf_config(rope, q_lora_rank)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    cfg = MLAModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                         q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=16, v_head_dim=12, intermediate_size=80,
                         max_position=128, rms_norm_eps=hf_cfg.rms_norm_eps,
                         **hf_rope_config(hf_cfg))
    model = TinyDeepseek(cfg, AttentionConfig(backend=backend)).eval()
    load_hf_deepseek(model, hf)
    return hf, model.to(DEVICE)


def _steps(model, seqs, prompts, decodes, forward=None):
    """Logits per request of a prefill of ``prompts`` tokens, then ``decodes`` decode steps of
    one token each, through shuffled pages of NaN-filled latent caches."""
    forward = forward or model
    alloc = BlockAllocator(NUM_BLOCKS, model.block_size, shuffle=True, seed=1)
    caches = model.allocate_kv_caches(NUM_BLOCKS)
    for cache in caches:
        cache.fill_(float("nan"))
    out = [[] for _ in seqs]
    starts = [0] * len(seqs)
    for step in range(decodes + 1):
        lens = list(prompts) if step == 0 else [1] * len(seqs)
        common = build_batch(alloc, list(range(len(seqs))), starts, lens, device=DEVICE)
        ids = torch.cat([s[c:c + n] for s, c, n in zip(seqs, starts, lens)]).to(DEVICE)
        logits = forward(ids, common.positions, caches, common).cpu()
        for r, n in enumerate(lens):
            out[r].append(logits[:n])
            logits = logits[n:]
        starts = [c + n for c, n in zip(starts, lens)]
    return [torch.cat(o) for o in out]


def _seqs(lengths):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["v3", "v2_lite_no_q_lora"])
@pytest.mark.parametrize("case", CASES)
def test_yarn_tiny_deepseek_reproduces_hf_logits(case, q_lora_rank):
    """Prefill of two requests (34 and 39 tokens, past the 32 pretrained positions), then three
    decode steps, against HF's logits over each whole sequence."""
    hf, model = _pair(CASES[case], q_lora_rank)
    prompts, decodes = [34, 39], 3
    seqs = _seqs([n + decodes for n in prompts])
    with torch.no_grad():
        want = [hf(s[None]).logits[0] for s in seqs]
        got = _steps(model, seqs, prompts, decodes)
    for r in range(len(seqs)):
        torch.testing.assert_close(got[r][:prompts[r]], want[r][:prompts[r]], **TOL,
                                   msg=lambda m, r=r: f"request {r} prefill: {m}")
        torch.testing.assert_close(got[r][prompts[r]:], want[r][prompts[r]:], **TOL,
                                   msg=lambda m, r=r: f"request {r} decodes: {m}")


@pytest.mark.parametrize("case", CASES)
def test_yarn_parameters_are_hfs(case):
    """Our frequencies, cos/sin factor and softmax scale are HF's own (its rotary embedding's
    ``inv_freq`` / ``attention_scaling``, its attention's ``scaling``), and the config
    exercises each: interpolated, blended and kept frequencies, a scale != plain RoPE's."""
    hf, model = _pair(CASES[case])
    yarn, rotary = model.cfg.rope_scaling, hf.model.rotary_emb
    inv_freq = yarn.inv_freq(model.cfg.qk_rope_head_dim, model.cfg.rope_theta)
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert yarn.cos_sin_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    spec = model.layers[0].attn.spec
    assert spec.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert spec.softmax_scale != pytest.approx(32 ** -0.5)  # (plain: qk width 16 + 16)
    plain = 1.0 / model.cfg.rope_theta ** (torch.arange(0, 16, 2) / 16)
    ratio = inv_freq / plain
    kept, interpolated = ratio == 1, torch.isclose(ratio, torch.tensor(1 / yarn.factor))
    assert kept.any() and interpolated.any() and not (kept | interpolated).all()
    if case == "mscale_ratio":
        assert yarn.cos_sin_factor == pytest.approx(1.0531183607806681)


@pytest.mark.slow
def test_yarn_reaches_the_fused_rope_cache_write_when_compiled():
    """Compiled with our passes, each layer's RoPE runs fused into the latent write
    (``mla_rope_cache_update``), given the model's YaRN cos/sin: HF's logits still."""
    import torch._inductor.config as inductor_config

    from attn_ops import build_step_metadata
    from attn_ops.compile_passes import fusion_passes
    from attn_ops.compile_passes.base import attn_ops_in
    from attn_ops.compile_passes.manager import AttnPassManager

    hf, model = _pair(MSCALE_RATIO)
    prompts, decodes = [34, 39], 1
    seqs = _seqs([n + decodes for n in prompts])
    seen = []
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)

    def forward(ids, positions, caches, common):
        return compiled(ids, positions, caches, build_step_metadata(model, common))

    with torch.no_grad(), inductor_config.patch(
            post_grad_custom_post_pass=AttnPassManager(
                [*fusion_passes(), lambda graph: seen.append(attn_ops_in(graph))]),
            fx_graph_cache=False):
        want = [hf(s[None]).logits[0] for s in seqs]
        got = _steps(model, seqs, prompts, decodes, forward)
    assert seen and all(ops.count("mla_rope_cache_update") == 2 and "mla_rope" not in ops
                        for ops in seen), seen
    for r in range(len(seqs)):
        torch.testing.assert_close(got[r], want[r], **TOL)


def test_hf_rope_config_reads_both_keys_and_refuses_other_rope_types():
    legacy = hf_rope_config(_hf_config(DEEPSEEK_V3))
    assert legacy == {"rope_theta": 10000.0, "rope_scaling": YarnScaling(
        factor=40.0, original_max_position=32, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
        mscale_all_dim=1.0)}
    assert hf_rope_config(_hf_config(MSCALE_RATIO))["rope_theta"] == 500.0
    assert hf_rope_config(_hf_config({})) == {"rope_theta": 10000.0, "rope_scaling": None}
    # a transformers-4 style config object: rope_scaling and rope_theta, no rope_parameters
    old = type("OldConfig", (), dict(rope_scaling=dict(DEEPSEEK_V3["rope_scaling"]),
                                     rope_theta=5000.0, max_position_embeddings=128))()
    assert hf_rope_config(old)["rope_theta"] == 5000.0
    assert hf_rope_config(old)["rope_scaling"] == legacy["rope_scaling"]
    for rope_type in ("linear", "dynamic"):
        cfg = _hf_config(dict(rope_scaling={"type": rope_type, "factor": 2.0}))
        with pytest.raises(ValueError, match=f"RoPE type '{rope_type}' is not supported"):
            hf_rope_config(cfg)


def test_loading_into_a_model_built_without_hfs_rope_scaling_is_an_error():
    hf = transformers.DeepseekV3ForCausalLM(_hf_config(DEEPSEEK_V3)).eval()
    cfg = MLAModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                         q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=16, v_head_dim=12, intermediate_size=80,
                         max_position=128)
    model = TinyDeepseek(cfg, AttentionConfig(backend="REFERENCE_MLA"))
    with pytest.raises(ValueError, match=r"hf_rope_config\(hf.config\)"):
        load_hf_deepseek(model, hf)
