"""HF transformers on attn_ops (``attn_ops.hf``): models of each family loaded with
``attn_implementation="attn_ops"`` against the same weights under HF's own ``"sdpa"`` /
``"eager"`` (the peers), on left-padded batches: forward logits and greedy ``generate``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=256,
            pad_token_id=0)


@pytest.fixture(autouse=True)
def _hfs_own_recurrence_on_the_cpu(monkeypatch):
    """HF's Qwen3-Next calls fla's Triton kernels wherever fla is installed, whatever the
    tensors' device, so its CPU models fail on a GPU machine: these CPU tests hold ours to
    HF's own torch recurrence, which it runs where fla is absent."""
    import functools
    import importlib

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        hub = getattr(module, name, None)
        if getattr(hub, "__wrapped__", None) is None:
            continue

        @functools.wraps(hub.__wrapped__)
        def own(*args, _torch=hub.__wrapped__, **kwargs):
            return _torch(*args, **kwargs)

        monkeypatch.setattr(module, name, own)


def _family(name: str):
    """``(config class, config kwargs, the HF implementation it is held to)``."""
    t = transformers
    return {
        "llama": (t.LlamaConfig, {}, "sdpa"),
        "qwen2": (t.Qwen2Config, {}, "sdpa"),  # (a QKV bias)
        "qwen3": (t.Qwen3Config, {}, "sdpa"),  # (q / k norms)
        "mistral": (t.MistralConfig, dict(sliding_window=5), "sdpa"),
        "gemma2": (t.Gemma2Config, dict(sliding_window=5, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=None, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"]),
                   "eager"),
        "gpt_oss": (t.GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=5,
                                         layer_types=["sliding_attention", "full_attention"]),
                    "eager"),
        # (a hybrid: HF's Gated DeltaNet layer beside an attention layer served by attn_ops)
        "qwen3_next": (t.Qwen3NextConfig, dict(
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32), "sdpa"),
    }[name]


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt_oss", "qwen3_next"]


def _models(name: str, **overrides):
    """The family's tiny model under HF's implementation and under attn_ops, same weights
    (random, the sinks and norms too), fp32, eval; ``overrides``: config fields changed."""
    from attn_ops import hf

    hf.register()
    cls, extra, peer = _family(name)
    fields = {**BASE, **extra, **overrides}
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(
        cls(**fields, attn_implementation=peer)).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    ours = transformers.AutoModelForCausalLM.from_config(
        cls(**fields, attn_implementation="attn_ops")).eval()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _batch(lens=(9, 5, 12), width: int = 12, seed: int = 1):
    """Prompts of ``lens`` tokens (random ids), left-padded to ``width``: ``(ids, mask)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, width - n:] = torch.randint(1, 101, (n,), generator=g)
        mask[r, width - n:] = 1
    return ids, mask


def _assert_same_logits(theirs, ours):
    """The left-padded batch's forward logits at every real position, fp32 tolerance."""
    ids, mask = _batch()
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=2e-4, rtol=2e-4)


def _assert_same_greedy(theirs, ours, new: int, device: str = "cpu", batch=None,
                        **ours_kwargs):
    """Greedy ``generate`` of ``new`` tokens over the left-padded ``batch`` (default
    :func:`_batch`'s): the same tokens, each step's logits within fp32 tolerance
    (``ours_kwargs``: to ours only, e.g. a cache)."""
    ids, mask = (t.to(device) for t in (batch or _batch()))
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        want = theirs.generate(ids, **kwargs)
        got = ours.generate(ids, **ours_kwargs, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    return got


def _returned_cache(out):
    """The cache a ``generate`` returned (``cache`` in transformers 5.2x, ``past_key_values``
    before)."""
    got = getattr(out, "cache", None)
    return got if got is not None else getattr(out, "past_key_values", None)


def _with_cache(model, cache) -> dict:
    """``generate``'s keyword for a cache: ``cache=`` in transformers 5.2x, ``past_key_values=``
    before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters
            else "past_key_values": cache}


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_logits_are_hfs_on_a_left_padded_batch(name):
    """Every real position's logits equal HF's own implementation's (fp32 tolerance), through
    each layer's selected attn_ops backend (the layers record it: ``hf.describe``)."""
    from attn_ops import hf

    theirs, ours = _models(name)
    _assert_same_logits(theirs, ours)
    text = hf.describe(ours)
    attention_layers = sum(t != "linear_attention" for t in
                           getattr(ours.config, "layer_types", None) or ["full_attention"] * 2)
    assert text.count("-> ") == attention_layers and "not run" not in text
    assert text.splitlines()[-1] == "generate: K/V in attn_ops pages"


def test_sinks_changed_in_place_or_replaced_are_read_again():
    """GPT-OSS's sinks reach each layer's attention once, not at every call, and again after
    they change in place or the module gets another tensor: the logits stay HF's."""
    theirs, ours = _models("gpt_oss")
    _assert_same_logits(theirs, ours)
    with torch.no_grad():
        for model in (theirs, ours):
            for m in model.modules():
                if hasattr(m, "sinks"):
                    m.sinks.add_(0.7)
    _assert_same_logits(theirs, ours)
    for model in (theirs, ours):
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks = torch.nn.Parameter(-m.sinks.detach().clone())
    _assert_same_logits(theirs, ours)


@pytest.mark.parametrize("cache", ["default", "dynamic"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generate_gives_hfs_tokens(name, cache):
    """Greedy ``generate`` of 6 tokens over the left-padded batch (decode steps of one token
    each): the same tokens as HF's implementation, each step's logits within fp32 tolerance --
    over the cache ``generate`` makes by default (attn_ops pages where every layer is
    attention; HF's for a hybrid model) and over HF's ``DynamicCache`` asked for by name."""
    from attn_ops import hf

    theirs, ours = _models(name)
    kwargs = {} if cache == "default" else {"cache_implementation": "dynamic"}
    got = _assert_same_greedy(theirs, ours, 6, **kwargs)
    owned = getattr(_returned_cache(got), "attn_ops_owned", False)
    assert owned == (cache == "default" and hf.cache_supported(ours) is None)


def test_generate_keeps_hfs_cache_where_attn_ops_pages_cannot_follow():
    """Beam search reorders and ``register(generate_cache=False)`` opts out: ``generate`` then
    makes HF's own cache, and the tokens are still HF's implementation's."""
    from attn_ops import hf

    theirs, ours = _models("llama")
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        want, got = theirs.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert not getattr(_returned_cache(got), "attn_ops_owned", False)
    try:
        hf.register(generate_cache=False)
        got = _assert_same_greedy(theirs, ours, 3)
        assert not getattr(_returned_cache(got), "attn_ops_owned", False)
    finally:
        hf.register()


def test_a_model_on_the_cpu_of_a_gpu_machine_runs_the_cpus_backends(monkeypatch):
    """The default device is a GPU (simulated: an H100) and the model stays on the CPU: each
    layer is selected for the device its tensors are on, so the CPU's backends serve it and
    the logits are HF's; a GPU backend handed CPU tensors would refuse them."""
    import attn_ops.selector
    from attn_ops import Platform, hf

    h100 = Platform.parse("cuda:9.0")
    monkeypatch.setattr(attn_ops.selector, "current_platform", lambda: h100)
    theirs, ours = _models("llama")
    _assert_same_logits(theirs, ours)
    assert "[simulated]" not in repr([layer.selection.platform for module in ours.modules()
                                      for layer in module.__dict__.get("_attn_ops_layers",
                                                                       {}).values()])
    assert hf.describe(ours).count("-> CPU_ATTN") == 2


def test_an_unpadded_batch_runs_without_a_mask_from_one_plan_a_step():
    """An unpadded batch (HF hands the function no mask): forward logits twice (the second
    over the plan the first made for those shapes) and greedy ``generate`` equal sdpa's."""
    theirs, ours = _models("llama")
    ids = torch.randint(1, 101, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = theirs(ids).logits
        for _ in range(2):
            torch.testing.assert_close(ours(ids).logits, want, atol=2e-4, rtol=2e-4)
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kwargs), theirs.generate(ids, **kwargs))


def test_register_is_idempotent_and_says_what_it_leaves_out():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from attn_ops import hf

    from packaging.version import Version

    first, again = hf.register(), hf.register()
    assert first == again
    assert AttentionInterface._global_mapping["attn_ops"] is hf.attention_forward
    assert "attn_ops" in AttentionMaskInterface._global_mapping
    if Version(transformers.__version__) >= Version("5.19"):  # (no third-party paged name)
        assert first.names == ("attn_ops",) and transformers.__version__ in first.paged_note
        assert "paged|attn_ops" not in AttentionInterface._global_mapping
    else:
        assert first.names == ("attn_ops", "paged|attn_ops") and first.paged_note == ""
        assert AttentionInterface._global_mapping["paged|attn_ops"] is \
            hf.paged_attention_forward
    for builtin in ("sdpa", "paged|eager"):  # (HF's own names stay HF's)
        assert AttentionInterface._global_mapping[builtin] is not hf.attention_forward


def test_what_attn_ops_cannot_serve_raises_naming_the_layer_and_feature():
    """A 4-D (custom) mask, a mask row with a hole and non-causal attention are refused with
    the layer and the implementation that serves them -- never computed as something else."""
    from attn_ops import hf

    _, ours = _models("llama")
    module = ours.model.layers[1].self_attn
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16)
    with pytest.raises(ValueError, match=r"LlamaAttention \(layer 1\).*4-D"):
        hf.attention_forward(module, q, k, k, torch.zeros(2, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="not one run"):
        hf.attention_forward(module, q, k, k, torch.tensor([[1, 0, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="non-causal"):
        hf.attention_forward(module, q, k, k, None, is_causal=False)
    with pytest.raises(ValueError, match="output_attentions.*eager"):
        hf.attention_forward(module, q, k, k, None, output_attentions=True)
    from attn_ops import AttentionConfig

    hf.register(AttentionConfig(backend="FLASHINFER"))  # (a backend that cannot run here)
    try:
        with pytest.raises(ValueError, match=r"LlamaAttention \(layer 1\).*FLASHINFER"):
            hf.attention_forward(ours.model.layers[1].self_attn, q, k, k, None, is_causal=True,
                                 sliding_window=3)
    finally:
        hf.register()


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_over_the_attn_ops_cache_gives_hfs_tokens(name):
    """``generate`` with ``cache=attn_ops.hf.cache(...)``: the K/V written once into attn_ops
    pages (pads never), each decode step reading them there -- the same tokens and logits as
    HF's implementation with its own cache; the cache's pages hold exactly the unpadded tokens.
    A hybrid model's recurrent layers keep HF's own cache layers beside them."""
    from attn_ops import hf

    theirs, ours = _models(name)
    owned = hf.cache(ours, batch=3, max_tokens=32)
    _assert_same_greedy(theirs, ours, 6, **_with_cache(ours, owned))
    _, mask = _batch()
    # (the last generated token is not fed back: prompt + 5 steps written; every layer's the
    # same pages, one plan a step)
    page = next(iter(owned.steps.by_page))
    assert owned.steps.tokens(page) == [int(m.sum()) + 5 for m in mask]
    assert len(owned.steps.by_page) == 1


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma2", "gpt_oss"])
def test_random_configs_and_padding_generate_hfs_tokens(name):
    """A head layout (GQA groups of 1-3, head dims not powers of two), sliding window and left
    padding drawn at random (seeded by the family): ``generate`` with HF's cache and with
    ``attn_ops.hf.cache`` gives HF's tokens and logits. (Eager Gemma 2 gives NaN where a
    padded row's window holds only padding; the windows drawn here are wider than the pads.)"""
    import random

    from attn_ops import hf

    rng = random.Random(name)
    seed = rng.randrange(1 << 16)
    kv, group, d = rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([8, 24, 40])
    overrides = dict(num_attention_heads=kv * group, num_key_value_heads=kv, head_dim=d,
                     hidden_size=12 * kv * group)
    if name in ("mistral", "gemma2", "gpt_oss"):
        overrides["sliding_window"] = rng.choice([13, 16])
    if name == "gemma2":
        overrides["query_pre_attn_scalar"] = d
    theirs, ours = _models(name, **overrides)
    lens = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
    batch, new = _batch(lens, 12, seed), rng.randint(1, 6)
    _assert_same_greedy(theirs, ours, new, batch=batch)
    owned = hf.cache(ours, batch=len(lens), max_tokens=12 + new)
    _assert_same_greedy(theirs, ours, new, batch=batch, **_with_cache(ours, owned))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_attn_ops_cache_replays_decode_steps_from_per_layer_cuda_graphs(name):
    """On a GPU an attn_ops cache's decode steps replay each layer's write and attention
    from a CUDA graph (its sinks, windows and soft-caps included): HF's tokens and logits
    still, over prompts whose pages fill and grow during the generation (the graphs
    recaptured over the grown pages) -- every layer replayed on all but its first two
    decode steps, and the same tokens as the cache run eagerly (``cuda_graphs=False``)."""
    from attn_ops import hf

    theirs, ours = (m.cuda() for m in _models(name))
    owned = hf.cache(ours, batch=3, max_tokens=64)
    new = 24
    got = _assert_same_greedy(theirs, ours, new, "cuda", **_with_cache(ours, owned))
    page = next(iter(owned.steps.by_page))
    # (decode steps: new - 1; the first over graph metadata runs eagerly, a warm-up; each
    # growth of the pages after it recaptures)
    assert [layer.replays for layer in owned.layers] == [new - 2] * len(owned.layers)
    captures = {tuple(layer.captures) for layer in owned.layers}
    assert len(captures) == 1, captures
    held = captures.pop()
    assert len(held) >= 2 and list(held) == sorted(set(held)), (page, held)
    assert held[-1] == owned.layers[0].kv.shape[0]
    eager = hf.cache(ours, batch=3, max_tokens=64, cuda_graphs=False)
    again = _assert_same_greedy(theirs, ours, new, "cuda", **_with_cache(ours, eager))
    assert torch.equal(again.sequences, got.sequences)
    assert all(layer.replays == 0 for layer in eager.layers)
    # (generate's own cache: the second generate takes over the first's graphs and replays
    # them from its first decode step, capturing none)
    hf.release(ours)
    captured = []
    for _ in range(2):
        out = _assert_same_greedy(theirs, ours, new, "cuda")
        made = _returned_cache(out)
        captured.append([list(layer.captures) for layer in made.layers])
        replays = [layer.replays for layer in made.layers]
        del out, made
    assert captured[0] == captured[1] and replays == [new - 1] * len(replays)
    hf.release(ours)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])
def test_graphed_decode_steps_advance_the_graph_buffers_on_the_device(name, monkeypatch):
    """The decode graph path of an attn_ops cache, here on the CPU with each layer's graph
    run eagerly over its graph metadata: a step one token past the last in every row, none
    entering a page, advances the graph buffers in place (``CUDAGraphBatch.advance``); a step
    entering a page pads them again -- and greedy ``generate`` gives HF's tokens and logits,
    and the eager cache's tokens, over rows whose pages fill during the generation."""
    import attn_ops.backend as backend
    import attn_ops.layers.attention as attention
    from attn_ops import hf
    from attn_ops.capabilities import CUDAGraphSupport
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.hf import owned_cache
    from attn_ops.hf.common import _rows_of

    monkeypatch.setattr(owned_cache._Steps, "_graphs_on", staticmethod(lambda device: True))
    monkeypatch.setattr(attention.Attention, "cudagraph_support", property(
        lambda self: CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE))
    monkeypatch.setattr(backend.AttentionBackend, "graph_metadata",
                        lambda self, padded, graphs: padded)
    made = owned_cache._layer_class

    def eager_graphs():
        class Layer(made()):
            def _graphed(self, layer, meta, query, key, value):  # (the graph's step, run)
                self.replays += 1
                out = layer(_rows_of(query), _rows_of(key), _rows_of(value), self.kv, meta)
                return out.to(query.dtype).view(query.shape[0], 1, query.shape[1],
                                                 value.shape[3])
        return Layer

    monkeypatch.setattr(owned_cache, "_layer_class", eager_graphs)
    calls = {"advance": 0, "pad_arrays": 0}
    for what in calls:
        def counted(self, *args, _f=getattr(CUDAGraphBatch, what), _what=what):
            calls[_what] += 1
            return _f(self, *args)
        monkeypatch.setattr(CUDAGraphBatch, what, counted)
    theirs, ours = _models(name)
    owned = hf.cache(ours, batch=3, max_tokens=64)
    new = 24
    got = _assert_same_greedy(theirs, ours, new, **_with_cache(ours, owned))
    page = next(iter(owned.steps.by_page))
    lens = [9, 5, 12]  # (_batch's rows: decode step i writes position len + i - 1)
    # (padded: the first decode step, and each step whose token enters a page in some row)
    padded = {1} | {i for i in range(1, new) if any((n + i - 1) % page == 0 for n in lens)}
    assert len(padded) > 2, page
    assert calls == {"advance": new - 1 - len(padded), "pad_arrays": len(padded)}, (page, calls)
    assert all(layer.replays == new - 1 for layer in owned.layers)
    eager = hf.cache(ours, batch=3, max_tokens=64, cuda_graphs=False)
    again = _assert_same_greedy(theirs, ours, new, **_with_cache(ours, eager))
    assert torch.equal(again.sequences, got.sequences)


def test_attn_ops_cache_scatters_a_decode_steps_tokens_as_the_write_op_does():
    """A decode step of an attn_ops cache whose new tokens enter no page writes them with two
    index copies into the NHD cache: the same bytes as the cache-write op. A step with a token
    entering a page (whose tail the op clears), more than one token a row, or a cache the
    copies cannot address (fp8, another layout) keeps the op."""
    import numpy as np

    from attn_ops.hf.owned_cache import _scatter_rows, _scatter_write
    from attn_ops.kv_cache import kv_cache_update

    page, g = 4, torch.Generator().manual_seed(3)
    table = np.array([[5, 2, 7], [1, 6, 0]], dtype=np.int32)
    ctx = [9, 2]  # (request 0 at row 1 of its third page, request 1 at row 2 of its first)
    rows = _scatter_rows(table, ctx, [1, 1], page, "cpu")
    key, value = (torch.randn(2, 3, 8, generator=g) for _ in range(2))
    want = torch.randn(8, 2, page, 3, 8, generator=g)
    got = want.clone()
    kv_cache_update(key, value, want, torch.tensor([7 * page + 1, 1 * page + 2]), None, None)
    assert _scatter_write(got, key, value, rows)
    assert torch.equal(got, want)
    assert _scatter_rows(table, [8, 2], [1, 1], page, "cpu") is None  # (9th token enters)
    assert _scatter_rows(table, [9, 2], [2, 1], page, "cpu") is None
    assert not _scatter_write(got.to(torch.float16), key, value, rows)
    assert not _scatter_write(got.transpose(0, 1), key, value, rows)


def test_attn_ops_cache_holds_the_pages_its_rows_reach():
    """A cache made for far more tokens than a generation uses holds pages for what its rows
    reached (its capacity doubling as they grow, the pages copied over), not ``batch x
    max_tokens`` up front -- and the tokens are still HF's."""
    from attn_ops import hf

    theirs, ours = _models("llama")
    owned = hf.cache(ours, batch=3, max_tokens=100_000)
    _assert_same_greedy(theirs, ours, 20, **_with_cache(ours, owned))
    page = next(iter(owned.steps.by_page))
    reached = sum(-(-n // page) for n in owned.steps.tokens(page))
    held = {layer.kv.shape[0] for layer in owned.layers}
    assert len(held) == 1 and reached <= held.pop() <= 2 * reached


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_generate_takes_over_the_pages_its_last_cache_left(name):
    """The cache ``generate`` made, once gone, leaves its attention layers' pages (and on a
    GPU their decode graphs) to the model's next ``generate`` of as many rows and no more
    tokens: the same tensors, every leftover in them NaN and never read -- HF's tokens and
    logits again, a hybrid's recurrent layers in fresh HF cache layers. While a returned
    cache is alive, or for more rows, a generate makes its own; ``release`` drops them, and
    kept pages never keep their model alive."""
    import gc

    from attn_ops import hf

    theirs, ours = _models(name)
    hf.release(ours)
    out = _assert_same_greedy(theirs, ours, 6)
    first = _returned_cache(out)
    steps = first.steps
    held = {i: layer.kv for i, layer in enumerate(first.layers) if hasattr(layer, "kv")}
    recurrent = [layer for layer in first.layers if not hasattr(layer, "kv")]
    assert held and (name == "qwen3_next") == bool(recurrent)
    alive = _returned_cache(_assert_same_greedy(theirs, ours, 4))  # (the first still held)
    assert alive.steps is not steps
    del alive  # (then the first: the last cache gone is the one kept)
    del out, first
    gc.collect()
    for kv in held.values():
        kv.fill_(float("nan"))
    again = _returned_cache(_assert_same_greedy(theirs, ours, 5))
    assert again.steps is steps
    assert all(again.layers[i].kv is kv for i, kv in held.items())
    assert not any(layer in recurrent for layer in again.layers)
    del again  # (then six tokens again: what the first cache's blocks hold, though the last
    # generation asked for five)
    assert _returned_cache(_assert_same_greedy(theirs, ours, 6)).steps is steps
    ids, mask = _batch()
    with torch.no_grad():  # (four rows: a cache of its own)
        more = ours.generate(torch.cat([ids, ids[:1]]), attention_mask=torch.cat([mask, mask[:1]]),
                             max_new_tokens=2, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
    assert _returned_cache(more).steps is not steps
    del more
    assert hf.release(ours) and not hf.release(ours)
    with torch.no_grad():  # (pages kept again: they do not keep the model alive)
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                      pad_token_id=0)
    import weakref

    model = weakref.ref(ours)
    del ours, steps, held
    gc.collect()
    assert model() is None


def test_attn_ops_cache_refuses_a_model_that_changes_the_keys_it_returned():
    """The attention call reads the history from the pages only when it receives the very key
    tensor the cache's ``update`` returned; keys changed in between leave the layer's pages
    without those tokens, and its next update refuses rather than serve a step without them."""
    from attn_ops import hf

    _, ours = _models("llama")
    module = ours.model.layers[0].self_attn
    owned = hf.cache(ours, batch=1, max_tokens=16)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    new_k, new_v = owned.update(k, k.clone(), 0)
    with torch.no_grad():
        hf.attention_forward(module, q, new_k * 1.0, new_v, None)  # (another tensor)
    with pytest.raises(ValueError, match=r"layer 0.*never reached the attention function"):
        owned.update(k[:, :, :1], k[:, :, :1], 0)


def _paged_served() -> str | None:
    """Why this transformers cannot run ``"paged|attn_ops"`` (None: it can). Under
    ``ATTN_OPS_EXPECT_PAGED=1`` (``make test-hf-paged``, over a transformers that must serve
    it) a reason is an error, not a skip."""
    import os

    from attn_ops import hf

    note = hf.register().paged_note or None
    if note and os.environ.get("ATTN_OPS_EXPECT_PAGED") == "1":
        raise RuntimeError(f"ATTN_OPS_EXPECT_PAGED=1, but {note}")
    return note


def _per_layer_paged_cache() -> bool:
    """Whether this transformers' ``PagedAttentionCache`` keeps a K and a V tensor a layer
    (5.17; 5.18 cuts one flat tensor into sectors), the layout read in place."""
    import inspect

    from transformers.generation.continuous_batching import cache as cb_cache

    return "self.key_cache" in inspect.getsource(cb_cache.PagedAttentionCache.__init__)


@pytest.mark.skipif(_paged_served() is not None, reason=str(_paged_served()))
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral", "gemma2"])
def test_generate_batch_over_paged_attn_ops_gives_generates_tokens(name):
    """Continuous batching (``generate_batch``, HF's paged cache, its scheduler mixing prefills
    and decodes) with ``"paged|attn_ops"``: each prompt's greedy tokens those of ``generate``
    with HF's own implementation on the same weights -- full-attention layers over HF's own
    pages in place, window layers (Mistral; Gemma 2's alternating with full ones) over the
    window HF's cache gathers, prompts longer than it."""
    from transformers import GenerationConfig

    from attn_ops import hf

    theirs, ours = _models(name)
    prompts = [[5, 17, 33, 2, 9, 41, 7, 8, 60], [3, 3, 91], [11] * 13, [44, 2, 76, 19, 1, 8]]
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64,
                                               **({"block_size": 16} if hasattr(
                                                   transformers.ContinuousBatchingConfig(),
                                                   "block_size") else {"page_size": 16}))
    with torch.no_grad():
        got = ours.generate_batch(prompts, generation_config=config,
                                  continuous_batching_config=cb, warmup=False)
        for i, p in enumerate(prompts):
            want = theirs.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist()
            out = next(o for o in got.values() if list(o.prompt_ids) == p)
            assert list(out.generated_tokens) == want, (i, out.generated_tokens, want)
    layers = [line for line in hf.describe(ours).splitlines() if "-> " in line]
    modes = [line.split("paged|attn_ops: ")[1] for line in layers]
    window = _family(name)[1].get("layer_types", ["sliding_attention"] * 2 if name ==
                                  "mistral" else ["full_attention"] * 2)
    in_place = _per_layer_paged_cache()
    for mode, kind in zip(modes, window):  # (full-attention layers over HF's own pages)
        assert (mode == "reads HF's paged cache in place") == (
            kind == "full_attention" and in_place), mode


@pytest.mark.skipif(_paged_served() is not None, reason=str(_paged_served()))
@pytest.mark.parametrize("name,window,lengths", [("mistral", 16, (23, 7, 19)),
                                                 ("mistral", 32, (40, 7, 23)),
                                                 ("gemma2", 32, (40, 7, 23))])
def test_window_layers_decode_over_hfs_ring_of_pages(name, window, lengths, monkeypatch):
    """Windows of whole pages (16 tokens): window layers decode over HF's ring of pages in
    place (a ring of one page and of two), other steps over the window HF gathers -- prompts
    longer than the window, decodes wrapping the ring several times: the tokens of
    ``generate``, and of the same run copying every step's window."""
    from transformers import GenerationConfig

    from attn_ops import hf

    theirs, _ = _models(name, sliding_window=window)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 101, (n,), generator=g).tolist() for n in lengths]
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64,
                                               block_size=16)

    def run():
        ours = _models(name, sliding_window=window)[1]  # (a new model: its layers' modes)
        with torch.no_grad():
            got = ours.generate_batch(prompts, generation_config=config,
                                      continuous_batching_config=cb, warmup=False)
        return [list(next(o for o in got.values() if list(o.prompt_ids) == p)
                     .generated_tokens) for p in prompts], hf.describe(ours)

    ring, text = run()
    assert not _per_layer_paged_cache() or "in place at decode-only steps" in text
    with torch.no_grad():
        for p, tokens in zip(prompts, ring):
            assert tokens == theirs.generate(torch.tensor([p]), max_new_tokens=40,
                                             do_sample=False, pad_token_id=0)[0, len(p):].tolist()
    from attn_ops.hf import paged

    inner = paged._reads_in_place  # (the same run, every window copied)
    monkeypatch.setattr(paged, "_reads_in_place", lambda c, layer, w, i: inner(c, layer, w, i) or (
        "copied" if w else None))
    assert run()[0] == ring


@pytest.mark.skipif(_paged_served() is not None, reason=str(_paged_served()))
def test_paged_attn_ops_copies_where_hfs_cache_tensors_are_held_elsewhere(monkeypatch):
    if not _per_layer_paged_cache():
        pytest.skip("this transformers' paged cache is one tensor of sectors: never taken over")
    """HF's paged cache tensors held beyond its lists (as its CPU offloading keeps views of
    them) are not taken over: every layer gathers and copies, the same tokens come out, and
    describe says why."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching import cache as cb_cache

    from attn_ops import hf

    held = []
    init = cb_cache.PagedAttentionCache.__init__

    def holding(self, *args, **kwargs):
        init(self, *args, **kwargs)
        held.append(self.key_cache[0].view(-1))

    monkeypatch.setattr(cb_cache.PagedAttentionCache, "__init__", holding)
    theirs, ours = _models("llama")
    prompts = [[5, 17, 33, 2, 9, 41, 7, 8, 60], [3, 3, 91]]
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32,
                                               block_size=16)
    with torch.no_grad():
        got = ours.generate_batch(prompts, generation_config=config,
                                  continuous_batching_config=cb, warmup=False)
        for p in prompts:
            want = theirs.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist()
            out = next(o for o in got.values() if list(o.prompt_ids) == p)
            assert list(out.generated_tokens) == want
    assert held and "held elsewhere" in hf.describe(ours)


def _deepseek():
    """A tiny DeepSeek-V3 (MLA with a q LoRA, interleaved RoPE, dense MLPs) under HF's sdpa,
    and the same weights loaded with attn_ops and patched (``hf.patch``)."""
    from attn_ops import hf

    hf.register()
    kw = dict(vocab_size=101, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2,
              rope_interleave=True, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **kw, attn_implementation="sdpa")).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    ours = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **kw, attn_implementation="attn_ops")).eval()
    ours.load_state_dict(theirs.state_dict())
    assert hf.patch(ours) == 2 and hf.patch(ours) == 0  # (once)
    return theirs, ours


def test_patched_deepseek_runs_mla_absorbed_as_hf_does():
    """DeepSeek-V3 through ``hf.patch``: its attention on attn_ops' MLA layer (the absorbed
    form over latents, each layer's backend in ``describe``) -- left-padded forward logits and
    greedy ``generate`` tokens and logits equal HF's sdpa over per-head expanded K/V."""
    from attn_ops import hf

    theirs, ours = _deepseek()
    _assert_same_logits(theirs, ours)
    text = hf.describe(ours)
    assert text.count("AttentionSpec(mla heads=4") == 2 and "not run" not in text
    assert "generate: HF's own cache (its MLA modules are patched" in text
    got = _assert_same_greedy(theirs, ours, 5)
    # (its MLA modules read HF's latent cache: generate keeps HF's, hf.cache refuses, saying why)
    assert not getattr(_returned_cache(got), "attn_ops_owned", False)
    with pytest.raises(ValueError, match="MLA modules are patched"):
        hf.cache(ours, batch=3, max_tokens=32)


@pytest.mark.parametrize("heads", [(2, 4), (2, 2)])
def test_patched_qwen3_next_runs_its_gated_deltanet_on_attn_ops(heads, monkeypatch):
    """Qwen3-Next through ``hf.patch``: its Gated DeltaNet recurrences on attn_ops' GDN backend
    (HF's own functions, counted, never reached from the patched model), its attention through
    ``"attn_ops"`` -- left-padded forward logits and greedy ``generate`` tokens and logits equal
    HF's on the same weights (a prefill, then decodes from the states in HF's cache); value
    heads twice the key heads and equal."""
    import sys

    from attn_ops import hf
    from attn_ops.hf import patching

    theirs, ours = _models("qwen3_next", linear_num_key_heads=heads[0],
                           linear_num_value_heads=heads[1])
    assert hf.patch(ours) == 1 and hf.patch(ours) == 0  # (one GDN layer, once)
    module = sys.modules[type(ours.model.layers[0].linear_attn).__module__]
    calls = []
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        def counted(*a, _hfs=getattr(module, name).__wrapped__, **k):  # (HF's own, counted)
            calls.append(1)
            return _hfs(*a, **k)

        monkeypatch.setattr(module, name, patching._gdn_dispatcher(counted, "chunk" in name))
    ids, mask = _batch()
    with torch.no_grad():
        ours(ids, attention_mask=mask)
        ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                      pad_token_id=0)
    assert not calls  # (the patched model never reaches HF's recurrence)
    _assert_same_logits(theirs, ours)
    assert calls  # (the peer does)
    _assert_same_greedy(theirs, ours, 4)
    text = hf.describe(ours)
    assert "gated_deltanet" in text and "-> GDN" in text, text


def test_the_in_place_step_reads_block_tables_from_hfs_indices():
    """``paged|attn_ops``' plan over HF's own pages: each request's block table read from HF's
    read index (its pages' first rows), requests in decode-first order (a prefill chunk
    packed before a decode), the slots HF's write index names; with an empty read index (no
    history in the step) the tables come from the write index."""
    from attn_ops.hf.paged import _InPlaceStep

    # (request 0: a 3-token chunk after 3 tokens; request 1: a decode after 8)
    page, tables = 4, {0: [5, 2], 1: [7, 1, 3]}

    def rows(r, positions):
        return [tables[r][p // page] * page + p % page for p in positions]

    read = torch.tensor(rows(0, range(6)) + rows(1, range(9)))
    write = torch.tensor(rows(0, range(3, 6)) + rows(1, [8]))
    step = _InPlaceStep([0, 3, 4], [0, 6, 15], read, write, page, 10, "cpu")
    meta = step.metadata
    assert step.query_rows.tolist() == [3, 0, 1, 2]
    assert meta.seq_lens_cpu.tolist() == [9, 6] and meta.query_lens_cpu.tolist() == [1, 3]
    assert meta.block_table_cpu[0, :3].tolist() == [7, 1, 3]
    assert meta.block_table_cpu[1, :2].tolist() == [5, 2]
    assert meta.slot_mapping.tolist() == write[[3, 0, 1, 2]].tolist()
    fresh = torch.tensor(rows(0, range(3)) + rows(1, range(1)))  # (two fresh prefills)
    step = _InPlaceStep([0, 3, 4], [0, 3, 4], torch.empty(0, dtype=torch.long), fresh, page, 10,
                        "cpu")
    assert step.query_rows.tolist() == [3, 0, 1, 2]
    assert step.metadata.slot_mapping.tolist() == fresh[[3, 0, 1, 2]].tolist()
    with pytest.raises(ValueError, match="no read index but requests with history"):
        _InPlaceStep([0, 3, 4], [0, 6, 15], torch.empty(0, dtype=torch.long), write, page, 10,
                     "cpu")
