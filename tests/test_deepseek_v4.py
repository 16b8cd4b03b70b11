"""DeepSeek-V4's attention parts against HF transformers' DeepseekV4 modules (the peers): the
compressor over prefills, chunked prefills that end mid-group and decodes, batched, its state
in slots; the compressed caches' slot mapping against its rule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attn_ops import build_batch
from attn_ops.backends.deepseek_v4.compressor import (compressed_slot_mapping,
                                                      compressor_entries,
                                                      compressor_state_rows, finish_entries)

transformers = pytest.importorskip("transformers")
hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _on_device(fn, *args):
    """``fn(*args)`` on :data:`DEVICE` (DSV4_TRITON's kernels: the GPU, or the CPU in Triton's
    interpreter), the tests' CPU tensors (also inside dicts, lists and tuples) moved there with
    their strides, every one copied back after the call (the caches and states it wrote) and
    the outputs returned on the CPU: a test builds and checks its tensors on the CPU alike."""
    if DEVICE.type == "cpu":
        return fn(*args)
    moved = []

    def there(a):
        if torch.is_tensor(a):
            d = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=DEVICE)
            moved.append((a, d.copy_(a)))
            return d
        if isinstance(a, dict):
            return {k: there(v) for k, v in a.items()}
        if isinstance(a, (list, tuple)):
            return type(a)(there(v) for v in a)
        return a

    out = fn(*[there(a) for a in args])
    for a, d in moved:
        a.copy_(d)
    return torch.utils._pytree.tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, out)


def _config(head_dim=64, rope_dim=16, index_heads=2):
    """The study's small valid config (every layer kind; CSA ratio 4, HCA 8); ``head_dim`` 512
    with 64 rotary dims: V4's entry width (its cache format)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim,
        qk_rope_head_dim=rope_dim, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention"],
        num_hidden_layers=4, index_n_heads=index_heads, index_head_dim=max(32, rope_dim),
        index_topk=3,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2,
        hc_sinkhorn_iters=3, max_position_embeddings=256, vocab_size=100,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1})


# (new tokens of requests A and B) a step: prefills, a chunk ending mid-group, decodes, one
# request idle in a step
STEPS = ((13, 5), (3, 0), (1, 7), (1, 1), (6, 2), (1, 1), (9, 3))


def _compressor(kind, cfg):
    """HF's compressor of ``kind`` with random weights (its position bias is zero-initialised)
    and its layer index in ``cfg``."""
    torch.manual_seed(0)
    cls = {"heavily_compressed_attention": hf_v4.DeepseekV4HCACompressor,
           "compressed_sparse_attention": hf_v4.DeepseekV4CSACompressor}[kind]
    module = cls(cfg).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        module.kv_norm.weight.uniform_(0.5, 1.5)
    return module, cfg.layer_types.index(kind)


def _hf_entries(module, cfg, layer, x, q_res, steps):
    """HF's running compressed entries of one request stepped ``steps`` tokens at a time."""
    from transformers import DynamicCache

    cache, done = DynamicCache(config=cfg), 0
    for n in steps:
        if n:
            pos = torch.arange(done, done + n)[None]
            with torch.no_grad():
                entries, _ = module(x[:, done:done + n], q_res[:, done:done + n], pos, cache,
                                    layer)
            done += n
    return entries[0, 0]


@pytest.mark.parametrize("kind", ["heavily_compressed_attention", "compressed_sparse_attention"])
def test_compressor_entries_are_hfs_over_chunked_steps(kind):
    """Two requests stepped together through the op (their partial groups carried in state
    slots, NaN-poisoned where unused) give, after our RMSNorm and interleaved RoPE at ``w * m``
    (:func:`finish_entries`), the compressed entries HF's compressor emits for each request
    stepped alone with its incremental cache -- the same entries in the same order, over
    every step."""
    cfg = _config()
    module, layer = _compressor(kind, cfg)
    ratio, overlap = module.compress_rate, kind == "compressed_sparse_attention"
    total = [sum(s[i] for s in STEPS) for i in range(2)]
    x = [torch.randn(1, n, cfg.hidden_size) for n in total]
    q_res = [torch.randn(1, n, cfg.q_lora_rank) for n in total]
    want = [_hf_entries(module, cfg, layer, x[i], q_res[i], [s[i] for s in STEPS])
            for i in range(2)]  # (HF: each request alone, its cache carrying the groups)

    width = module.kv_proj.out_features
    state = torch.full((4, compressor_state_rows(ratio, overlap), 2 * width), float("nan"))
    got, done = [[], []], [0, 0]
    for step in STEPS:
        ids = [i for i in range(2) if step[i]]
        rows = torch.cat([x[i][0, done[i]:done[i] + step[i]] for i in ids])
        qsl = torch.tensor([0, *torch.tensor([step[i] for i in ids]).cumsum(0).tolist()])
        seq = torch.tensor([done[i] + step[i] for i in ids])
        with torch.no_grad():
            entries = compressor_entries(module.kv_proj(rows), module.gate_proj(rows),
                                         module.position_bias.detach(), state, qsl, seq,
                                         torch.tensor([2 + i for i in ids]), ratio, overlap)
        for j, i in enumerate(ids):
            for t in range(step[i]):
                p = done[i] + t
                if (p + 1) % ratio == 0:
                    got[i].append((p // ratio, entries[qsl[j] + t]))
            done[i] += step[i]
    for i in range(2):
        w = torch.tensor([e for e, _ in got[i]])
        assert w.tolist() == list(range(len(w)))  # (one entry per completed group, in order)
        raw = torch.stack([e for _, e in got[i]])
        with torch.no_grad():  # (our RMSNorm and interleaved RoPE at w * m, HF's angles)
            cos, sin = module.rotary_emb(raw, position_ids=(w * ratio)[None],
                                         layer_type="compress")
            mine = finish_entries(raw, module.kv_norm.weight, cfg.rms_norm_eps,
                                  torch.cat([cos[0], sin[0]], -1))
        torch.testing.assert_close(mine, want[i], atol=1e-5, rtol=1e-5)
    assert state[[0, 1]].isnan().all()  # (no other slot written)


def test_compressed_slot_mapping_follows_its_rule():
    """Device ops against the rule written out per token: entry ``p // m`` where ``(p + 1) % m
    == 0``, through the request's block-table row, -1 elsewhere (padding rows, entries past
    the row); negative block ids clamped to 0."""
    g = torch.Generator().manual_seed(3)
    ratio, bs = 4, 3
    new, ctx = [1, 1, 9, 5, 0], [7, 30, 0, 12, 3]
    seq = [c + n for c, n in zip(ctx, new)]
    table = torch.randint(0, 50, (5, 4), generator=g)
    table[1, 2] = -4
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()])
    got = compressed_slot_mapping(qsl, torch.tensor(seq), table, ratio, bs, sum(new) + 3)
    want = []
    for r in range(5):
        for i in range(new[r]):
            p = ctx[r] + i
            idx = p // ratio
            ok = (p + 1) % ratio == 0 and idx // bs < table.shape[1] and \
                int(table[r, idx // bs]) >= 0  # (a negative block id: no page, no write)
            want.append(int(table[r, idx // bs]) * bs + idx % bs if ok else -1)
    want += [-1] * 3
    assert got.tolist() == want
    assert any(v >= 0 for v in want) and want.count(-1) > 3


def test_ops_pass_opcheck():
    g = torch.Generator().manual_seed(4)
    kv, gate = (torch.randn(9, 16, generator=g) for _ in range(2))
    state = torch.randn(3, compressor_state_rows(4, True), 32, generator=g)
    step = (torch.tensor([0, 2, 9]), torch.tensor([6, 7]), torch.tensor([1, 2]))
    torch.library.opcheck(compressor_entries, (kv, gate, torch.randn(4, 16, generator=g),
                                               state, *step, 4, True))
    torch.library.opcheck(compressed_slot_mapping, (step[0], step[1],
                                                    torch.randint(0, 9, (2, 3), generator=g),
                                                    4, 2, 11))
    from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES, entry_write

    torch.library.opcheck(entry_write, (torch.randn(3, 512, generator=g),
                                        torch.zeros(2, 4 * ENTRY_BYTES, dtype=torch.uint8),
                                        torch.tensor([1, -1, 6]), 4))
    from attn_ops.backends.deepseek_v4.reference import indexer_topk, reference_attention

    window, compressed = torch.randn(4, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    step = (torch.tensor([0, 1, 4]), torch.tensor([9, 7]), torch.tensor([[0, 1, 2], [3, 2, 1]]))
    picks = torch.tensor([[1, -1], [0, -1], [-1, -1], [0, 1]])
    torch.library.opcheck(reference_attention, (torch.randn(4, 2, 16, generator=g), window,
                                                *step, torch.randn(2, generator=g), 0.25, 4,
                                                compressed, torch.tensor([[0, 1], [2, 0]]), 4,
                                                picks))
    torch.library.opcheck(indexer_topk, (torch.randn(4, 2, 16, generator=g),
                                         torch.randn(4, 2, generator=g), compressed,
                                         step[0], step[1], torch.tensor([[0, 1], [2, 0]]), 4,
                                         2))
    if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1":
        from attn_ops.backends.deepseek_v4.backend import triton_attention, triton_indexer_topk

        _on_device(lambda *a: torch.library.opcheck(triton_attention, a),
                   torch.randn(4, 2, 16, generator=g), window,
                   *step, torch.randn(2, generator=g), 0.25, 4, 8, compressed,
                   torch.tensor([[0, 1], [2, 0]]), 4, picks, [16, 16, 4, 1, 2])
        from attn_ops.backends.deepseek_v4.backend import compress_write, triton_entry_write

        _on_device(lambda *a: torch.library.opcheck(triton_entry_write, a),
                   torch.randn(3, 512, generator=g), torch.zeros(2, 4 * ENTRY_BYTES,
                                                                 dtype=torch.uint8),
                   torch.tensor([1, -1, 6]), False)
        _on_device(lambda *a: torch.library.opcheck(compress_write, a),
                   kv, gate, torch.randn(4, 16, generator=g), state.clone(),
                   torch.tensor([0, 2, 9]), torch.tensor([6, 7]), torch.tensor([1, 2]),
                   torch.tensor([[0, 1], [2, 1]]), 4, True, torch.rand(8, generator=g), 1e-6,
                   torch.randn(8, 4, generator=g), torch.zeros(3, 2, 8), False)
        _on_device(lambda *a: torch.library.opcheck(triton_indexer_topk, a),
                   torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, generator=g),
                   compressed, step[0], step[1], torch.tensor([[0, 1], [2, 0]]), 4, 2)


def test_entries_are_vllms_584_bytes_planar_in_their_page():
    """An entry: the vector rounded to bf16, dims 0..447 as e4m3 in groups of 64 with UE8M0
    scales (``2^ceil(log2(max(amax, 1e-4) / 448))``, stored as exponent + 127), dims 448..511
    as bf16; a page of B entries holds B x 576 data bytes, then B x 8 scale bytes. Reading
    back: within e4m3's rounding (2^-4 of each element in its normal range), the rope dims
    exact; slot -1 and slots outside the cache skipped."""
    from attn_ops.backends.deepseek_v4.cache import (ENTRY_BYTES, entry_write, read_entries)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 512, generator=g) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(
        2)[:, None]
    x[0, 64:128] = 0.0  # (an all-zero group: the 1e-4 floor)
    bs = 4
    cache = torch.full((3, bs * ENTRY_BYTES), 0xAB, dtype=torch.uint8)
    slots = torch.tensor([5, 0, -1, 11, 99, 6])
    entry_write(x, cache, slots, bs)
    back = read_entries(cache, bs, torch.tensor([5, 0, 11, 6]))
    want = x[[0, 1, 3, 5]].to(torch.bfloat16).float()
    assert torch.equal(back[:, 448:], want[:, 448:])  # (bf16 rope dims)
    big = want[:, :448].abs() > 2 ** -6 * want[:, :448].abs().amax(-1, keepdim=True)
    rel = ((back[:, :448] - want[:, :448]).abs() / want[:, :448].abs().clamp_min(1e-30))[big]
    assert rel.max() <= 2 ** -4
    # the layout: entry 5 = block 1, row 1; its scales in the scale plane, 7 bytes + a zero
    amax = x[0, :64].to(torch.bfloat16).float().abs().amax()
    assert int(cache[1, bs * 576 + 8]) == math.ceil(math.log2(amax / 448)) + 127
    assert int(cache[1, bs * 576 + 8 + 1]) == math.ceil(math.log2(1e-4 / 448)) + 127  # (0s)
    assert int(cache[1, bs * 576 + 8 + 7]) == 0
    assert torch.equal(cache[1, 576 + 448:2 * 576].view(torch.bfloat16),
                       x[0, 448:].to(torch.bfloat16))
    assert (cache[2, bs * 576 + 3 * 8:bs * 576 + 4 * 8 - 1] != 0xAB).all()  # (11: block 2, 3)
    assert (cache[0, 576:2 * 576] == 0xAB).all()  # (no row but the written ones)
    assert (cache[0, bs * 576 + 8:bs * 576 + 16] == 0xAB).all()


@pytest.mark.parametrize("kind,index", [("heavily_compressed_attention", False),
                                        ("compressed_sparse_attention", False),
                                        ("compressed_sparse_attention", True)],
                         ids=["hca", "csa", "csa_index_keys"])
def test_a_step_compressed_into_the_cache_reads_back_as_hfs_entries(kind, index):
    """V4's entry width (512 = 448 + 64 rotary): two requests' steps through
    :func:`compress_into_cache` -- entries, RMSNorm, interleaved RoPE at ``w * m``, 584-byte
    fp8 entries at their compressed slots -- read back as HF's compressor's entries within
    e4m3's rounding (each group of 64 within 2^-3 of its largest element; rotary dims bf16).
    ``index``: written as the indexer's keys are (``index=True``: e4m3 over one power-of-two
    scale an entry, vLLM's planar index pages), each within 2^-3 of its largest element."""
    from attn_ops.backends.deepseek_v4.cache import (ENTRY_BYTES, dequantize_index_keys,
                                                     index_views, read_entries)
    from attn_ops.backends.deepseek_v4.compressor import compress_into_cache

    cfg = _config(head_dim=512, rope_dim=64)
    module, layer = _compressor(kind, cfg)
    ratio, overlap = module.compress_rate, kind == "compressed_sparse_attention"
    steps = ((13, 9), (3, 1), (6, 7), (1, 1))
    total = [sum(s[i] for s in steps) for i in range(2)]
    x = [torch.randn(1, n, cfg.hidden_size) for n in total]
    q_res = [torch.randn(1, n, cfg.q_lora_rank) for n in total]
    want = [_hf_entries(module, cfg, layer, x[i], q_res[i], [s[i] for s in steps])
            for i in range(2)]
    positions = torch.arange(64)[None]
    cos, sin = module.rotary_emb(torch.zeros(1), position_ids=positions, layer_type="compress")
    table = torch.cat([cos[0], sin[0]], -1)  # [positions, 64]: the pairs' cos | sin
    bs, width = 4, module.kv_proj.out_features
    cache = torch.full((16, bs * (cfg.head_dim + 4 if index else ENTRY_BYTES)), 0xFF,
                       dtype=torch.uint8)
    block_table = torch.tensor([[3, 7, 1, 0], [9, 2, 12, 5]])
    state = torch.full((2, compressor_state_rows(ratio, overlap), 2 * width), float("nan"))
    written, done = [{}, {}], [0, 0]
    for step in steps:
        rows = torch.cat([x[i][0, done[i]:done[i] + step[i]] for i in range(2)])
        qsl = torch.tensor([0, step[0], step[0] + step[1]])
        seq = torch.tensor([done[0] + step[0], done[1] + step[1]])
        with torch.no_grad():
            slots = compress_into_cache(module.kv_proj(rows), module.gate_proj(rows),
                                        module.position_bias.detach(), state, qsl, seq,
                                        torch.tensor([0, 1]), block_table, ratio, overlap,
                                        module.kv_norm.weight.detach(), cfg.rms_norm_eps, table,
                                        cache, bs, index=index)
        for i in range(2):
            for t in range(step[i]):
                if slots[qsl[i] + t] >= 0:
                    written[i][(done[i] + t) // ratio] = int(slots[qsl[i] + t])
            done[i] += step[i]
    for i in range(2):
        assert sorted(written[i]) == list(range(want[i].shape[0]))
        slots = torch.tensor([written[i][w] for w in range(want[i].shape[0])])
        if index:
            got = dequantize_index_keys(cache, cfg.head_dim, slots)
            error = (got - want[i]).abs().amax(-1)
            assert (error <= 2 ** -3 * want[i].abs().amax(-1)).all()
            scales = index_views(cache, cfg.head_dim)[1].flatten()[slots]
            assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
            continue
        got = read_entries(cache, bs, slots)
        ref = want[i].to(torch.bfloat16).float()
        groups = (got[:, :448] - ref[:, :448]).abs().unflatten(1, (7, 64)).amax(-1)
        scale = ref[:, :448].abs().unflatten(1, (7, 64)).amax(-1)
        assert (groups <= 2 ** -3 * scale + 1e-6).all()
        torch.testing.assert_close(got[:, 448:], ref[:, 448:], atol=1e-5, rtol=2 ** -7)


def _v4_backends(dtype=torch.float32, kv_cache_dtype="auto"):
    """Every backend of the family, skipped (with its reasons) where it cannot serve a
    compressed-sparse layer of ``dtype`` / ``kv_cache_dtype`` here."""
    from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
    from attn_ops.platforms import current_platform
    from attn_ops.registry import KIND_BACKENDS, get_backend_class

    probe = DeepseekV4Spec("compressed_sparse_attention", compress_ratio=4, index_heads=64,
                           index_head_dim=128, index_topk=512, dtype=dtype,
                           kv_cache_dtype=kv_cache_dtype)
    params = []
    for b in KIND_BACKENDS["deepseek_v4"]:
        reasons = get_backend_class(b.value).not_supported_reasons(probe, current_platform())
        why = "; ".join(r.message for r in reasons)
        params.append(pytest.param(b.value, marks=pytest.mark.skipif(
            bool(reasons), reason=f"{b.value} cannot serve it here: {why}")))
    return params


def _peer_cases():
    """(kind, fp8, backend, schedule): every kind with rows on every backend; the 584-byte
    entries on the reference for every kind and on the kernels for the compressed-sparse kind
    (which runs all of their entry paths: window, compressed entries, picks); at the small
    width, the fixed steps and steps drawn at random too."""
    kinds = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
    for b in _v4_backends():
        for fp8 in (False, True):
            for kind in kinds:
                if fp8 and b.values[0] != "DSV4_REFERENCE" and \
                        kind != "compressed_sparse_attention":
                    continue
                for schedule in ("fixed",) if fp8 else ("fixed", "drawn"):
                    yield pytest.param(kind, fp8, *b.values, schedule, marks=b.marks,
                                       id=f"{kind}-{'fp8_entries' if fp8 else 'dense'}-"
                                          f"{b.values[0]}-{schedule}")


@pytest.mark.parametrize("kind,fp8,backend,schedule", list(_peer_cases()))
def test_the_layer_reproduces_hfs_attention_over_prefills_chunks_and_decodes(kind, fp8,
                                                                               backend, schedule):
    """Our layer, loaded from HF's ``DeepseekV4Attention`` (random weights, sinks and position
    bias), over paged window and compressed caches with the compressor's state in a slot:
    a prefill, a chunk ending mid-group, decodes -- each step's outputs HF's (fp32; HF given
    the sliding-window causal mask the study prescribes). ``fp8_entries``: V4's width (512 =
    448 + 64) with the window and compressed caches in vLLM's 584-byte entries: HF's outputs
    within e4m3's error (relative L2 under 5%). Every backend of the family, forced.
    ``drawn``: step lengths drawn at random (seeded by the case) instead of the fixed ones."""
    import random

    from transformers import DynamicCache

    from attn_ops import AttentionConfig, BlockAllocator, build_batch
    from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES
    from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
    from attn_ops.spec import LayerKind

    torch.manual_seed(1)
    # (ReLU scores tie at 0 when every head's is: rare at 16 indexer heads)
    cfg = _config(512, 64, index_heads=16) if fp8 else _config(index_heads=16)
    layer_idx = cfg.layer_types.index(kind)
    hf = hf_v4.DeepseekV4Attention(cfg, layer_idx).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = DeepseekV4Attention.from_hf(hf, cfg, attention_config=AttentionConfig(
        backend_per_kind={LayerKind.DEEPSEEK_V4: backend})).to(DEVICE)
    assert ours.backend == backend
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    kind_rope = "main" if kind == "sliding_attention" else "compress"
    steps = (13, 0, 3, 1, 1, 6, 1)  # (a step without rows: served, nothing changes)
    if schedule == "drawn":
        rng = random.Random(f"{kind}-{backend}")
        steps = [rng.randint(1, 13)]
        while sum(steps) < 30:
            steps.append(rng.choice([0, 1, 1, 2, 3, rng.randint(4, 9)]))
    total = sum(steps)
    x = torch.randn(1, total, cfg.hidden_size)
    cos, sin = rotary(x, torch.arange(total)[None], layer_type=kind_rope)
    table = torch.cat([cos[0], sin[0]], -1)
    page = 4
    alloc = BlockAllocator(16, page, shuffle=True, seed=2)
    window = torch.full((16, page, cfg.head_dim), float("nan"))
    ratio = ours.ratio or 1
    compressed = torch.full((8, 2, cfg.head_dim), float("nan"))
    if fp8:  # (0xFF bytes: NaN entries where unwritten)
        window = torch.full((16, page * ENTRY_BYTES), 0xFF, dtype=torch.uint8)
        compressed = torch.full((8, 2 * ENTRY_BYTES), 0xFF, dtype=torch.uint8)
    index_keys = torch.full((8, 2, cfg.index_head_dim), float("nan"))
    c_table = torch.tensor([[5, 1, 7, 2, 0, 3, 6]])
    coff = 2 if kind == "compressed_sparse_attention" else 1
    state = torch.full((2, coff * ratio, 2 * coff * cfg.head_dim), float("nan"))
    index_state = torch.full((2, 2 * ratio, 4 * cfg.index_head_dim), float("nan"))
    cache, done = DynamicCache(config=cfg), 0
    for n in steps:
        pos = torch.arange(done, done + n)
        meta = build_batch(alloc, [0], [done], [n])
        step = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                    block_table=meta.block_table, slot_mapping=meta.slot_mapping,
                    compressed_block_table=c_table, state_indices=torch.tensor([1]))
        with torch.no_grad():
            got = _on_device(ours, x[0, done:done + n], pos, table, window, step, compressed,
                             state, index_keys, index_state)
        if n == 0:  # (HF's module takes no empty step)
            assert got.shape == (0, cfg.hidden_size)
            continue
        embeddings = {r: rotary(x, pos[None], layer_type=r) for r in ("main", "compress")}
        cached = min(done, cfg.sliding_window - 1)
        key_pos = torch.arange(done - cached, done + n)
        visible = (key_pos[None] <= pos[:, None]) & (pos[:, None] - key_pos[None]
                                                       < cfg.sliding_window)
        mask = torch.zeros(1, 1, n, key_pos.shape[0]).masked_fill(~visible, float("-inf"))
        with torch.no_grad():
            want, _ = hf(x[:, done:done + n], embeddings, pos[None], mask, cache)
        if fp8:
            assert ((got - want[0]).norm() / want[0].norm()) < 0.05
        else:
            torch.testing.assert_close(got, want[0], atol=2e-5, rtol=2e-5)
        done += n


def test_memory_arithmetic_of_a_long_request():
    """``benchmarks/dsv4_memory.py``: a 1M-token request's bytes per layer kind are the formats'
    -- 584-byte entries (window 128 tokens, C4A a quarter of the tokens, C128A a 128th),
    132-byte indexer keys, the compressors' fp32 state rows -- against V3.2's 656 + 132 bytes a
    token in every layer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import dsv4_memory as m

    ctx = 1 << 20
    assert m.layer_bytes("swa_only", ctx) == {"window": 128 * 584}
    c4 = m.layer_bytes("c4a", ctx)
    assert (c4["compressed"], c4["indexer_keys"]) == (ctx // 4 * 584, ctx // 4 * 132)
    assert c4["states"] == 8 * 2048 * 4 + 8 * 512 * 4  # (8 rows of [c | z + B], fp32)
    assert m.layer_bytes("c128a", ctx)["compressed"] == ctx // 128 * 584
    assert m.layer_bytes("c128a", 100)["compressed"] == 0  # (no complete group yet)
    assert m.v32_layer_bytes(ctx) == ctx * 788


def _v4_gpu_choice(spec) -> str:
    """The backend an sm90 GPU selects for a V4 ``spec``: DSV4_FLASHMLA where it serves it
    (FlashMLA imports with V4's interface, fp8 entries), else DSV4_TRITON."""
    from attn_ops.platforms import Platform
    from attn_ops.registry import get_backend_class

    flashmla = get_backend_class("DSV4_FLASHMLA")
    return ("DSV4_FLASHMLA" if not flashmla.not_supported_reasons(
        spec, Platform.parse("cuda:9.0")) else "DSV4_TRITON")


def test_v4_specs_select_their_family_and_are_refused_elsewhere_naming_why():
    """A DeepSeek-V4 spec is offered its family's backends only (on the H200 DSV4_FLASHMLA
    where FlashMLA imports, else DSV4_TRITON; DSV4_REFERENCE on the CPU); forcing an attention backend on its kind names the mismatch;
    DSV4_REFERENCE refuses an attention spec; a spec outside the model's shapes is refused
    naming the value."""
    from attn_ops import AttentionConfig, AttentionSpec, select_backend
    from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
    from attn_ops.platforms import Platform
    from attn_ops.registry import get_backend_class
    from attn_ops.selector import BackendNotSupportedError
    from attn_ops.spec import LayerKind

    spec = DeepseekV4Spec("compressed_sparse_attention", compress_ratio=4, index_heads=64,
                          index_head_dim=128, index_topk=512, kv_cache_dtype="fp8_ds_mla")
    for platform, backend in (("cpu", "DSV4_REFERENCE"), ("cuda:9.0", _v4_gpu_choice(spec))):
        selection = select_backend(spec, Platform.parse(platform))
        assert selection.backend == backend
        assert {c.name for c in selection.candidates} == {"DSV4_REFERENCE", "DSV4_TRITON",
                                                           "DSV4_FLASHMLA"}
    with pytest.raises(BackendNotSupportedError, match="FLASHINFER serves attention layers"):
        select_backend(spec, Platform.parse("cuda:9.0"), AttentionConfig(
            backend_per_kind={LayerKind.DEEPSEEK_V4: "FLASHINFER"}))
    reasons = get_backend_class("DSV4_REFERENCE").not_supported_reasons(
        AttentionSpec(num_heads=8, head_dim=64), Platform.parse("cpu"))
    assert reasons and reasons[0].code == "layer_kind"
    with pytest.raises(ValueError, match="compress_ratio=0"):
        DeepseekV4Spec("heavily_compressed_attention")
    with pytest.raises(ValueError, match="index_heads, index_head_dim and index_topk"):
        DeepseekV4Spec("compressed_sparse_attention", compress_ratio=4)
    with pytest.raises(ValueError, match="head_dim=64, rope_dim=16 need kv_cache_dtype='auto'"):
        DeepseekV4Spec("sliding_attention", head_dim=64, rope_dim=16,
                       kv_cache_dtype="fp8_ds_mla")


@pytest.mark.parametrize("flag", ["swa", "csa", "hca"])
def test_select_and_info_show_v4_layers(capsys, flag):
    from attn_ops.cli import main

    assert main(["select", "--dsv4", flag, "--kv-cache-dtype", "fp8_ds_mla", "--platform",
                 "cuda:9.0"]) == 0
    out = capsys.readouterr().out
    from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec

    kind = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
            "hca": "heavily_compressed_attention"}[flag]
    extra = dict(compress_ratio=4, index_heads=64, index_head_dim=128, index_topk=512) \
        if flag == "csa" else dict(compress_ratio=128) if flag == "hca" else {}
    choice = _v4_gpu_choice(DeepseekV4Spec(kind, kv_cache_dtype="fp8_ds_mla", **extra))
    assert f"selected: {choice} (auto)" in out and "kv_cache_dtype=fp8_ds_mla" in out
    assert main(["info", "--dsv4", flag]) == 0
    out = capsys.readouterr().out
    assert "DSV4_REFERENCE     available" in out and "DSV4_TRITON        " in out


@pytest.mark.parametrize("backend", _v4_backends())
def test_the_layer_compiles_fullgraph(backend):
    """A compressed-sparse layer under ``torch.compile(fullgraph=True)`` -- its compressors,
    indexer and attention as ops with fakes -- gives eager's outputs and caches over a prefill
    and a decode, on every backend of the family."""
    from attn_ops import AttentionConfig, BlockAllocator, build_batch
    from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
    from attn_ops.spec import LayerKind

    torch.manual_seed(3)
    cfg = _config(index_heads=16)
    hf = hf_v4.DeepseekV4Attention(cfg, 1).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = DeepseekV4Attention.from_hf(hf, cfg, attention_config=AttentionConfig(
        backend_per_kind={LayerKind.DEEPSEEK_V4: backend})).to(DEVICE)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1), torch.arange(32)[None], layer_type="compress")
    table = torch.cat([cos[0], sin[0]], -1)
    x = torch.randn(10, cfg.hidden_size)

    def caches():
        return (torch.zeros(8, 4, cfg.head_dim), torch.zeros(4, 2, cfg.head_dim),
                torch.zeros(2, 8, 4 * cfg.head_dim), torch.zeros(4, 2, cfg.index_head_dim),
                torch.zeros(2, 8, 4 * cfg.index_head_dim))

    eager, compiled = caches(), caches()
    torch._dynamo.reset()
    fn = torch.compile(layer, fullgraph=True)
    alloc = BlockAllocator(8, 4)
    for done, n in ((0, 9), (9, 1)):
        meta = build_batch(alloc, [0], [done], [n])
        step = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                    block_table=meta.block_table, slot_mapping=meta.slot_mapping,
                    compressed_block_table=torch.tensor([[2, 0, 3]]),
                    state_indices=torch.tensor([1]))
        pos = torch.arange(done, done + n)
        with torch.no_grad():
            want = _on_device(layer, x[done:done + n], pos, table, eager[0], step, *eager[1:])
            got = _on_device(fn, x[done:done + n], pos, table, compiled[0], step,
                             *compiled[1:])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _v4_matrix():
    """(backend, kind, scenario) of every backend of the DeepSeek-V4 family the registry holds
    (a new one enrolls itself; skipped where it cannot serve the fp32 layers here) x its three
    layer kinds x serving scenarios."""
    for backend in _v4_backends():
        for kind in ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"):
            for scenario in V4_SCENARIOS:
                if scenario != "mixed" and backend.values[0] == "DSV4_REFERENCE":
                    continue  # (the oracle of every backend's run already: itself in fp64)
                yield pytest.param(*backend.values, kind, scenario, marks=backend.marks,
                                   id=f"{backend.values[0]}-{kind}-{scenario}")


# (context, new tokens) a request, decode-first: decodes over long contexts (one completing a
# group: 22 = 0 mod 2), a fresh one-token request, a prefill, a chunk ending mid-group (15 =
# 3 mod 4); speculative decodes (2-4 draft tokens a request, as MTP verifies them), one
# completing a group of 4 in its middle token (21 + 3), one crossing into a new window page
V4_SCENARIOS = {"mixed": ((21, 1), (7, 1), (0, 1), (0, 9), (9, 6)),
                "speculative": ((21, 3), (6, 2), (13, 4), (31, 2))}


def _v4_step(alloc, ids, ctx, new, c_table, slots):
    meta = build_batch(alloc, ids, ctx, new)
    return dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                block_table=meta.block_table, slot_mapping=meta.slot_mapping,
                compressed_block_table=c_table, state_indices=slots)


@pytest.mark.parametrize("backend,kind,scenario", list(_v4_matrix()))
def test_v4_matrix_matches_the_fp64_reference(backend, kind, scenario):
    """Each backend of the family (forced on its kind) on a step of ``scenario``: the layer's
    caches (window, compressed, indexer keys) over permuted pages NaN-poisoned wherever no token
    of the requests was written, the compressors' state slots NaN but the requests' -- outputs
    finite and DSV4_REFERENCE's in fp64 on the same inputs (fp32 tolerance)."""
    from attn_ops import AttentionConfig, BlockAllocator
    from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
    from attn_ops.spec import LayerKind

    torch.manual_seed(7)
    cfg = _config(index_heads=16)
    hf = hf_v4.DeepseekV4Attention(cfg, cfg.layer_types.index(kind)).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    oracle = DeepseekV4Attention.from_hf(hf.double(), cfg)
    forced = AttentionConfig(backend_per_kind={LayerKind.DEEPSEEK_V4: backend})
    spec = dataclasses.replace(oracle.spec, dtype=torch.float32)
    ours = DeepseekV4Attention(spec, cfg.hidden_size, cfg.q_lora_rank, cfg.o_groups,
                               cfg.o_lora_rank, cfg.rms_norm_eps, forced)
    ours.load_state_dict({k: v.float() for k, v in oracle.state_dict().items()})
    ours.to(DEVICE)
    assert ours.backend == backend
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1), torch.arange(64)[None],
                      layer_type="main" if kind == "sliding_attention" else "compress")
    table = torch.cat([cos[0], sin[0]], -1)
    requests = V4_SCENARIOS[scenario]
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(c + n, cfg.hidden_size, generator=g) for c, n in requests]
    c_table = torch.randperm(40, generator=g)[:len(requests) * 8].view(len(requests), 8)
    state_slots = torch.arange(len(requests)) + 2
    coff = 2 if kind == "compressed_sparse_attention" else 1
    rows = coff * max(oracle.ratio, 1)
    outs = {}
    for dtype, layer in ((torch.float32, lambda *a: _on_device(ours, *a)),
                         (torch.float64, oracle)):
        alloc = BlockAllocator(64, 4, shuffle=True, seed=3)
        caches = [torch.full(shape, float("nan"), dtype=dtype) for shape in (
            (64, 4, cfg.head_dim), (40, 2, cfg.head_dim),
            (4 + len(requests), rows, 2 * coff * cfg.head_dim), (40, 2, cfg.index_head_dim),
            (4 + len(requests), rows, 4 * cfg.index_head_dim))]
        with torch.no_grad():
            for i, (c, _) in enumerate(requests):  # (each context: an earlier prefill)
                if c:
                    step = _v4_step(alloc, [i], [0], [c], c_table[i:i + 1],
                                    state_slots[i:i + 1])
                    layer(xs[i][:c].to(dtype), torch.arange(c), table.to(dtype), caches[0],
                          step, *caches[1:])
            step = _v4_step(alloc, list(range(len(requests))), [c for c, _ in requests],
                            [n for _, n in requests], c_table, state_slots)
            pos = torch.cat([torch.arange(c, c + n) for c, n in requests])
            new = torch.cat([x[c:] for x, (c, _) in zip(xs, requests)])
            outs[dtype] = layer(new.to(dtype), pos, table.to(dtype), caches[0], step,
                                *caches[1:])
    assert outs[torch.float32].isfinite().all()
    torch.testing.assert_close(outs[torch.float32].double(), outs[torch.float64], atol=1e-4,
                               rtol=1e-4)


def _paged_v4(reqs, d, fp8, page, cpage, ratio, gen, blocks=40):
    """Window and compressed caches of ``reqs`` ((context, new) each) over permuted pages:
    rows NaN-poisoned where no token was written (0xFF bytes: NaN entries, for ``fp8``'s
    584-byte entries), block tables ``[B, 8]``."""
    from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES, entry_write

    b = len(reqs)
    table = torch.randperm(blocks, generator=gen)[:b * 8].view(b, 8).int()
    c_table = torch.randperm(blocks, generator=gen)[:b * 8].view(b, 8).int()
    if fp8:  # (pages padded past their entries, as in vLLM's pool or ours: strided views)
        window = torch.full((blocks, page * ENTRY_BYTES + 64), 0xFF,
                            dtype=torch.uint8)[:, :page * ENTRY_BYTES]
        compressed = torch.full((blocks, cpage * ENTRY_BYTES + 64), 0xFF,
                                dtype=torch.uint8)[:, :cpage * ENTRY_BYTES]
    else:
        window = torch.full((blocks, page, d), float("nan"))
        compressed = torch.full((blocks, cpage, d), float("nan"))
    for r, (c, n) in enumerate(reqs):
        pos = torch.arange(c + n)
        entry_write(torch.randn(c + n, d, generator=gen), window,
                    table[r].long()[pos // page] * page + pos % page, page)
        e = torch.arange((c + n) // ratio)
        entry_write(torch.randn(e.shape[0], d, generator=gen), compressed,
                    c_table[r].long()[e // cpage] * cpage + e % cpage, cpage)
    return window, compressed, table, c_table


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mode", ["window", "dense", "picks"])
@pytest.mark.parametrize("fp8", [False, True], ids=["rows", "fp8_entries"])
def test_triton_attention_is_the_reference_on_adversarial_steps(fp8, mode, splits):
    """DSV4_TRITON's attention op against the torch reference on one step: decodes over long
    contexts, a fresh one-token request, a prefill, a chunk; permuted pages NaN-poisoned where
    unwritten; two padding rows past the last request (written zeros); picks with -1, repeats
    and entries not yet complete (ignored); window pages wholly behind every query's window
    released to -1 (never read); keys split over programs or not. ``fp8_entries``: V4's width
    (448 + 64) in vLLM's 584-byte entries."""
    from attn_ops.backends.deepseek_v4.backend import triton_attention
    from attn_ops.backends.deepseek_v4.reference import dsv4_attention_reference

    d, rope = (512, 64) if fp8 else (48, 16)
    g = torch.Generator().manual_seed(11 + splits)
    reqs, window_len, ratio, page, cpage = ((23, 1), (7, 1), (0, 1), (0, 6), (9, 5)), 6, 4, 4, 2
    window, compressed, table, c_table = _paged_v4(reqs, d, fp8, page, cpage, ratio, g)
    new = torch.tensor([n for _, n in reqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).int()
    seq = torch.tensor([c + n for c, n in reqs]).int()
    t = int(qsl[-1]) + 2
    q = torch.randn(t, 4, d, generator=g)
    sinks = torch.randn(4, generator=g)
    for r, (c, n) in enumerate(reqs):  # (pages every query of the request is past)
        first = max(0, c - window_len + 1)
        table[r, :first // page] = -1
    picks = None
    if mode == "picks":
        picks = torch.randint(-1, 7, (t, 5), generator=g)
        picks[:, 3] = picks[:, 2]
    compressed_args = (compressed, c_table, ratio, picks) if mode != "window" else (
        None, None, 0, None)
    want = dsv4_attention_reference(q[:t - 2], window, qsl, seq, table, sinks, d ** -0.5,
                                    window_len, *compressed_args)
    got = _on_device(triton_attention, q, window, qsl, seq, table, sinks, d ** -0.5,
                     window_len, rope, *compressed_args, [16, 16, 4, 1, splits])
    assert got[:t - 2].isfinite().all()
    torch.testing.assert_close(got[:t - 2], want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[t - 2:], torch.zeros_like(got[t - 2:]))


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
def test_triton_attention_reads_nothing_outside_its_caches():
    """Block ids past the cache or below -1 (a stale or corrupt table, inside the window and
    among the compressed entries) are absent like -1, not read: the outputs equal those over
    the tables with -1 there, and differ from the intact tables' (the pages were in use)."""
    from attn_ops.backends.deepseek_v4.backend import triton_attention

    g = torch.Generator().manual_seed(5)
    window, compressed, table, c_table = _paged_v4(((17, 1), (10, 3)), 32, False, 4, 2, 4, g,
                                                   blocks=16)
    qsl, seq = torch.tensor([0, 1, 4]).int(), torch.tensor([18, 13]).int()
    q, sinks = torch.randn(4, 2, 32, generator=g), torch.randn(2, generator=g)
    outs = []
    for absent in (None, -1, "corrupt"):
        w, c = table.clone(), c_table.clone()
        if absent is not None:
            w[0, 3], c[1, 1] = (-1, -1) if absent == -1 else (10 ** 6, -7)
        outs.append(_on_device(triton_attention, q, window, qsl, seq, w, sinks, 32 ** -0.5,
                               8, 8, compressed, c, 4, None, [16, 16, 4, 1, 2]))
    intact, released, corrupt = outs
    assert corrupt.isfinite().all()
    torch.testing.assert_close(corrupt, released, atol=0, rtol=0)
    assert not torch.allclose(intact[0], released[0]) and not torch.allclose(intact[1:],
                                                                             released[1:])


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("keys", ["rows", "fp8"])
def test_triton_indexer_picks_the_references_entries(keys):
    """DSV4_TRITON's indexer (DeepSeek-V3.2's scoring and device top-k over compressed
    entries, ``(p + 1) // ratio`` visible) picks the reference's set for every query row --
    decodes, a prefill whose early rows see fewer entries than top-k (all of them), a chunk --
    over permuted pages NaN-poisoned where unwritten; padding rows pick nothing. ``fp8``:
    vLLM's planar index entries (e4m3 keys over a power-of-two scale each) read by both; the
    queries e4m3 values (the kernel scores an fp8 cache with each head's query in e4m3)."""
    from attn_ops.backends.deepseek_v4.backend import triton_indexer_topk
    from attn_ops.backends.deepseek_v4.cache import index_write
    from attn_ops.backends.deepseek_v4.reference import dsv4_indexer_topk_reference

    g = torch.Generator().manual_seed(9)
    reqs, ratio, page, di, topk = ((41, 1), (30, 1), (0, 23), (17, 9)), 4, 4, 32, 5
    b = len(reqs)
    c_table = torch.randperm(48, generator=g)[:b * 12].view(b, 12).int()
    cache = torch.full((48, page, di), float("nan"))
    if keys == "fp8":
        cache = torch.full((48, page * (di + 4)), 0xFF, dtype=torch.uint8)
    for r, (c, n) in enumerate(reqs):
        e = torch.arange((c + n) // ratio)
        index_write(torch.randn(e.shape[0], di, generator=g), cache,
                    c_table[r].long()[e // page] * page + e % page)
    new = torch.tensor([n for _, n in reqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).int()
    seq = torch.tensor([c + n for c, n in reqs]).int()
    t = int(qsl[-1]) + 2
    q, w = torch.randn(t, 8, di, generator=g), torch.randn(t, 8, generator=g)
    if keys == "fp8":  # (e4m3 values, each head's amax 448: its query quantizes exactly)
        q = (q * 64).clamp(-440, 440).to(torch.float8_e4m3fn).float()
        q[:, torch.arange(8), torch.arange(8)] = 448.0  # (a channel a head: no common sign)
    want = dsv4_indexer_topk_reference(q[:t - 2], w[:t - 2], cache, qsl, seq, c_table, ratio,
                                       topk)
    got = _on_device(triton_indexer_topk, q, w, cache, qsl, seq, c_table, ratio, topk)
    for row in range(t - 2):
        assert set(got[row].tolist()) - {-1} == set(want[row].tolist()) - {-1}, row
    assert (want >= 0).sum() > 3 * (t - 2) and (got[t - 2:] == -1).all()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("ratio,overlap,fmt", [(8, False, "rows"), (4, True, "entries"),
                                               (4, True, "index"), (128, False, "entries")])
def test_triton_compressor_writes_the_torch_forms_entries_and_state(ratio, overlap, fmt):
    """DSV4_TRITON's compressor step (two launches) against ``compress_into_cache`` over two
    requests' steps -- prefills, a chunk ending mid-group, decodes, an idle request, a long
    prefill past its table's entries, two padding rows -- into permuted pages: the same state
    rows, the same rows (fp32) or entries (584-byte or planar index keys: the same bytes but
    where a last-bit difference of the sum flips a rounding, and the decoded entries within
    e4m3's step of each other)."""
    from attn_ops.backends.deepseek_v4.backend import compress_write
    from attn_ops.backends.deepseek_v4.cache import (ENTRY_BYTES, dequantize_index_keys,
                                                     read_entries)
    from attn_ops.backends.deepseek_v4.compressor import compress_into_cache

    g = torch.Generator().manual_seed(ratio + len(fmt))
    d = 512 if fmt == "entries" else 64
    width = (2 if overlap else 1) * d
    steps = ((255, 3), (1, 126)) if ratio == 128 else (
        (13, 9), (3, 1), (6, 7), (1, 1), (0, 5), (70, 2))
    bias = torch.randn(ratio, width, generator=g)
    states = [torch.full((3, compressor_state_rows(ratio, overlap), 2 * width), float("nan"))
              for _ in range(2)]
    rope = torch.randn(600, 64 if fmt == "entries" else 16, generator=g)
    norm = torch.rand(d, generator=g) + 0.5
    page = 4
    shape, dtype, fill = {"rows": ((40, page, d), torch.float32, float("nan")),
                          "entries": ((40, page * ENTRY_BYTES), torch.uint8, 0xFF),
                          "index": ((40, page * (d + 4)), torch.uint8, 0xFF)}[fmt]
    caches = [torch.full(shape, fill, dtype=dtype) for _ in range(2)]
    table = torch.randperm(40, generator=g)[:2 * 10].view(2, 10)
    done = [0, 0]
    for step in steps:
        n = sum(step)
        kv, gate = (torch.randn(n + 2, width, generator=g) for _ in range(2))
        args = (torch.tensor([0, step[0], n]), torch.tensor([done[0] + step[0],
                                                             done[1] + step[1]]),
                torch.tensor([2, 0]), table, ratio, overlap, norm, 1e-6, rope)
        compress_into_cache(kv[:n], gate[:n], bias, states[0], *args, caches[0], page,
                            index=fmt == "index")
        _on_device(compress_write, kv, gate, bias, states[1], *args, caches[1],
                   fmt == "index")
        done = [done[0] + step[0], done[1] + step[1]]
    torch.testing.assert_close(states[1], states[0], equal_nan=True)
    want, got = caches
    if fmt == "rows":
        torch.testing.assert_close(got, want, equal_nan=True, atol=1e-5, rtol=1e-5)
        return
    assert (got != want).sum() <= 2 and (want != 0xFF).sum() > 1000
    slots = torch.arange(40 * page)
    if fmt == "index":
        a, b = (dequantize_index_keys(c, d, slots) for c in (want, got))
        bound = 2 ** -3 * a.abs().amax(-1, keepdim=True)
    else:
        a, b = (read_entries(c, page, slots) for c in (want, got))
        bound = 2 ** -3 * a.abs().unflatten(1, (8, 64)).amax(-1).repeat_interleave(64, 1)
    written = a.isfinite().all(1)  # (0xFF bytes read back as NaN: never written)
    assert written.sum() >= (3 if ratio == 128 else 20)
    assert torch.equal(written, b.isfinite().all(1))
    assert ((a - b).abs()[written] <= bound[written]).all()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("fmt", ["rows", "entries", "index"])
def test_triton_window_write_is_the_torch_forms_bytes(fmt):
    """DSV4_TRITON's one-launch write of rows against ``entry_write`` / ``index_write``:
    byte for byte -- zero rows, rows far below the UE8M0 floor, -1 and slots past the cache
    skipped."""
    from attn_ops.backends.deepseek_v4.backend import triton_entry_write
    from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES, entry_write, index_write

    g = torch.Generator().manual_seed(3)
    d = 512 if fmt == "entries" else 64
    x = torch.randn(7, d, generator=g) * 3
    x[2], x[3, :64] = 0.0, x[3, :64] * 1e-6
    shape, dtype, fill = {"rows": ((5, 4, d), torch.float32, float("nan")),
                          "entries": ((5, 4 * ENTRY_BYTES), torch.uint8, 0xFF),
                          "index": ((5, 4 * (d + 4)), torch.uint8, 0xFF)}[fmt]
    want, got = (torch.full(shape, fill, dtype=dtype) for _ in range(2))
    slots = torch.tensor([0, 5, -1, 19, 3, 20, 7])
    if fmt == "index":
        index_write(x, want, slots)
    else:
        entry_write(x, want, slots, 4)
    _on_device(triton_entry_write, x, got, slots, fmt == "index")
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("backend", _v4_backends())
def test_window_pages_are_released_behind_the_window(backend):
    """A request served step after step with its window pages released as the window moves
    past them (``BlockAllocator.release_before``; the freed pages NaN-poisoned): the same outputs as keeping every page, and never more than ``ceil(W /
    page) + 1`` window pages held, plus those of the step's new tokens. A -1 where a query
    still reads is refused by the metadata, naming the rule."""
    from attn_ops import AttentionConfig, BlockAllocator, build_batch
    from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
    from attn_ops.spec import LayerKind

    torch.manual_seed(2)
    cfg = _config(index_heads=16)
    hf = hf_v4.DeepseekV4Attention(cfg, cfg.layer_types.index("heavily_compressed_attention"))
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer = DeepseekV4Attention.from_hf(hf.eval(), cfg, attention_config=AttentionConfig(
        backend_per_kind={LayerKind.DEEPSEEK_V4: backend})).to(DEVICE)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    cos, sin = rotary(torch.zeros(1), torch.arange(80)[None], layer_type="compress")
    table = torch.cat([cos[0], sin[0]], -1)
    x = torch.randn(60, cfg.hidden_size)
    page, window = 4, cfg.sliding_window
    outs = {}
    for release in (False, True):
        alloc = BlockAllocator(24, page, shuffle=True, seed=1)
        cache = torch.full((24, page, cfg.head_dim), float("nan"))
        compressed = torch.full((8, 2, cfg.head_dim), float("nan"))
        state = torch.full((2, 8, 2 * cfg.head_dim), float("nan"))
        got, done = [], 0
        for n in (13, 3, 1, 6, 1, 9, 1, 5, 1):
            meta = build_batch(alloc, [0], [done], [n], window=window)
            step = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                        block_table=meta.block_table, slot_mapping=meta.slot_mapping,
                        compressed_block_table=torch.tensor([[5, 1, 7, 2, 0, 3, 6, 4]]),
                        state_indices=torch.tensor([1]))
            with torch.no_grad():
                got.append(_on_device(layer, x[done:done + n], torch.arange(done, done + n),
                                      table, cache, step, compressed, state))
            done += n
            if release:
                before = set(alloc.blocks(0))
                alloc.release_before(0, done - window + 1)
                cache[sorted(before - set(alloc.blocks(0)))] = float("nan")
                held = [b for b in alloc.blocks(0) if b >= 0]
                assert len(held) <= -(-window // page) + 1
        outs[release] = torch.cat(got)
        if release:
            assert alloc.num_free_blocks >= 24 - (-(-window // page) + 1)
            with pytest.raises(ValueError, match="a released page, only before position"):
                build_batch(alloc, [0], [done - 20], [20], window=window)
    assert outs[True].isfinite().all()
    torch.testing.assert_close(outs[True], outs[False], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["DSV4_REFERENCE"])
def test_one_pool_serves_every_layer_kind_as_hf_does(backend):
    """Three layers (sliding-window, compressed-sparse, heavily compressed) of two requests
    stepped together -- prefills, chunks ending mid-group, decodes -- with every cache drawn
    from one arena of 64-token pages (``DeepseekV4CachePool``: 584-byte window and compressed
    entries, index keys as rows) and the window pages released as the windows move: each
    layer's outputs for each request HF's ``DeepseekV4Attention`` stepped alone (within e4m3's
    error), every page of the arena in one cache at a time, the pages a request holds those
    its caches' lengths need, and none left after both are freed. (The kernels' reads of pages
    strided in an arena: ``test_triton_attention_is_the_reference_on_adversarial_steps``.)"""
    from transformers import DynamicCache

    from attn_ops import AttentionConfig
    from attn_ops.backends.deepseek_v4.pool import DeepseekV4CachePool
    from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
    from attn_ops.spec import LayerKind

    torch.manual_seed(4)
    cfg = _config(512, 64, index_heads=16)
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    forced = AttentionConfig(backend_per_kind={LayerKind.DEEPSEEK_V4: backend})
    hfs, ours = [], []
    for kind in kinds:
        hf = hf_v4.DeepseekV4Attention(cfg, cfg.layer_types.index(kind)).eval()
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.3)
        hfs.append(hf)
        ours.append(DeepseekV4Attention.from_hf(hf, cfg, attention_config=forced))
    specs = [dataclasses.replace(layer.spec, kv_cache_dtype="fp8_ds_mla") for layer in ours]
    pool = DeepseekV4CachePool(specs, 40, window_page=4, index_fp8=False, num_state_slots=3)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    tables = {}
    for r in ("main", "compress"):
        cos, sin = rotary(torch.zeros(1), torch.arange(64)[None], layer_type=r)
        tables[r] = torch.cat([cos[0], sin[0]], -1)
    steps = ((13, 6), (3, 1), (1, 9), (1, 1), (6, 1))
    total = [sum(s[i] for s in steps) for i in range(2)]
    xs = [torch.randn(1, n, cfg.hidden_size) for n in total]
    hf_caches = [[DynamicCache(config=cfg) for _ in kinds] for _ in range(2)]
    done, released = [0, 0], 0
    for step in steps:
        ids = [i for i in range(2) if step[i]]
        for layer, (kind, hf, mine) in enumerate(zip(kinds, hfs, ours)):
            meta = pool.step(layer, ids, [done[i] for i in ids], [step[i] for i in ids])
            x = torch.cat([xs[i][0, done[i]:done[i] + step[i]] for i in ids])
            pos = torch.cat([torch.arange(done[i], done[i] + step[i]) for i in ids])
            rope = tables["main" if kind == "sliding_attention" else "compress"]
            c = pool.layers[layer]
            with torch.no_grad():
                got = mine(x, pos, rope, c.window, meta, c.compressed, c.state, c.index,
                           c.index_state)
            at = 0
            for i in ids:
                n, d0 = step[i], done[i]
                p = torch.arange(d0, d0 + n)
                emb = {r: rotary(xs[i], p[None], layer_type=r) for r in ("main", "compress")}
                key_pos = torch.arange(d0 - min(d0, cfg.sliding_window - 1), d0 + n)
                seen = (key_pos[None] <= p[:, None]) & (p[:, None] - key_pos[None]
                                                        < cfg.sliding_window)
                mask = torch.zeros(1, 1, n, key_pos.shape[0]).masked_fill(~seen, float("-inf"))
                with torch.no_grad():
                    want, _ = hf(xs[i][:, d0:d0 + n], emb, p[None], mask, hf_caches[i][layer])
                mine_i = got[at:at + n]
                assert ((mine_i - want[0]).norm() / want[0].norm()) < 0.05, (kind, i, step)
                at += n
        for i in ids:
            done[i] += step[i]
            before = pool.held_pages(i)["window"]
            pool.release_window(i, done[i] - cfg.sliding_window + 1)
            in_use = {p for pages in pool._pages.values() for p in pages if p >= 0}
            pool.arena[sorted(set(range(40)) - in_use)] = 0xFF  # (freed pages poisoned)
            released += before - pool.held_pages(i)["window"]
            held = pool.held_pages(i)
            assert held["window"] <= 3 * (-(-cfg.sliding_window // 4) + 1)
            assert held["compressed"] == sum(-(-(done[i] // m) // 4) for m in (4, 8))
    assert released >= 6
    used = [p for pages in pool._pages.values() for p in pages if p >= 0]
    assert len(used) == len(set(used)) == 40 - pool.num_free_pages
    for i in range(2):
        pool.free(i)
    assert pool.num_free_pages == 40


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_layer(kind: str, backend: str, dtype=torch.bfloat16):
    """A V4-Flash-width layer of ``kind`` (64 heads of 512 = 448 + 64, index 64 x 128 top-512,
    window 128) with random weights, on the GPU, forced on ``backend``."""
    from attn_ops import AttentionConfig
    from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
    from attn_ops.layers.deepseek_v4 import DeepseekV4Attention
    from attn_ops.spec import LayerKind

    ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4,
             "heavily_compressed_attention": 128}[kind]
    sparse = ratio == 4
    spec = DeepseekV4Spec(kind, compress_ratio=ratio, index_heads=64 if sparse else 0,
                          index_head_dim=128 if sparse else 0, index_topk=512 if sparse else 0,
                          dtype=dtype, kv_cache_dtype="fp8_ds_mla")
    torch.manual_seed(0)
    layer = DeepseekV4Attention(spec, 1024, 256, 8, 128, config=AttentionConfig(
        backend_per_kind={LayerKind.DEEPSEEK_V4: backend}))
    with torch.no_grad():
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.05)
        for name in ("q_a_norm", "kv_norm", "c_kv_norm", "i_kv_norm"):
            if hasattr(layer, name):
                getattr(layer, name).fill_(1.0)
    return layer.cuda().to(dtype)


def _gpu_caches(layer, blocks: int, slots: int):
    """Empty fp8 caches and fp32 state slots of ``layer`` on the GPU (pages of 64)."""
    from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES

    def z(*shape, dtype=torch.uint8):
        return torch.zeros(*shape, dtype=dtype, device="cuda")

    caches = [z(blocks, 64 * ENTRY_BYTES), None, None, None, None]
    if layer.compressed:
        coff = 2 if layer.sparse else 1
        caches[1] = z(blocks, 64 * ENTRY_BYTES)
        caches[2] = z(slots, coff * layer.ratio, 2 * coff * 512, dtype=torch.float32)
    if layer.sparse:
        caches[3] = z(blocks, 64 * 132)
        caches[4] = z(slots, 8, 4 * 128, dtype=torch.float32)
    return caches


@_GPU
@pytest.mark.parametrize("backend", [b for b in _v4_backends(torch.bfloat16, "fp8_ds_mla")
                                     if b.values[0] != "DSV4_REFERENCE"])
@pytest.mark.parametrize("kind", ["sliding_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention"])
def test_gpu_real_sizes_match_the_reference(monkeypatch, kind, backend):
    """V4-Flash widths on the GPU (bf16, fp8 entries, pages of 64): four requests -- prefills
    of 2k-5k tokens in chunks (one ending mid-group), then decodes -- through the layer on
    ``backend`` and on DSV4_REFERENCE over caches of their own: every step's outputs within
    bf16's tolerance of each other (the indexer's picks may differ only at ties). The indexer
    scores with the query as given (``mla.index_fp8_query`` off): its e4m3 query, the default,
    swaps entries near the top-k's edge, each a whole entry's weight of attention (2.8% here);
    test_indexer bounds that approximation against the reference.

    Under compute-sanitizer (``ATTN_OPS_MEMCHECK=1``, as ``gpu_round.sh dsv4check`` sets it)
    the backend runs alone, its outputs checked finite, over a first step of 4097 tokens for
    one request and short ones for the others (mid-group ends kept): the instrumented
    reference over all four prompts outlasts a device call, and the comparison is the plain
    GPU run's."""
    import os

    from attn_ops import BlockAllocator, build_batch

    monkeypatch.setenv("ATTN_OPS_TUNING", "mla.index_fp8_query=false")
    memcheck = os.environ.get("ATTN_OPS_MEMCHECK") == "1"
    first = (129, 67, 4097, 3) if memcheck else (2049, 1500, 4097, 3001)

    layers = {b: _gpu_layer(kind, b) for b in (backend,) + (() if memcheck
                                                            else ("DSV4_REFERENCE",))}
    if not memcheck:
        layers["DSV4_REFERENCE"].load_state_dict(layers[backend].state_dict())
    table = torch.randn(8192, 64, device="cuda")
    caches = {b: _gpu_caches(layer, 512, 6) for b, layer in layers.items()}
    allocs = {b: BlockAllocator(512, 64, shuffle=True, seed=1) for b in layers}
    c_table = torch.randperm(512)[:4 * 32].view(4, 32).int().cuda()
    lens = [0, 0, 0, 0]
    g = torch.Generator().manual_seed(1)
    for new in (first, (1, 1, 1023, 2), (1, 1, 1, 1), (1, 1, 1, 1)):
        x = torch.randn(sum(new), 1024, generator=g).cuda().to(torch.bfloat16)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(lens, new)]).cuda()
        outs = {}
        for b, layer in layers.items():
            meta = build_batch(allocs[b], [0, 1, 2, 3], lens, list(new), device="cuda")
            step = dict(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                        block_table=meta.block_table, slot_mapping=meta.slot_mapping,
                        compressed_block_table=c_table,
                        state_indices=torch.arange(4, dtype=torch.int32, device="cuda") + 1)
            with torch.no_grad():
                outs[b] = layer(x, pos, table, caches[b][0], step, *caches[b][1:]).float()
        assert outs[backend].isfinite().all()
        if not memcheck:
            err = (outs[backend] - outs["DSV4_REFERENCE"]).norm() / outs["DSV4_REFERENCE"].norm()
            assert err < 2e-2, (kind, new, float(err))
        lens = [c + n for c, n in zip(lens, new)]


@_GPU
@pytest.mark.parametrize("backend", [b for b in _v4_backends(torch.bfloat16, "fp8_ds_mla")
                                     if b.values[0] != "DSV4_REFERENCE"])
@pytest.mark.parametrize("kind", ["compressed_sparse_attention", "heavily_compressed_attention"])
def test_gpu_uniform_decodes_replay_in_a_cuda_graph(kind, backend):
    """A layer's decode step for 8 requests (each graph-capable backend) captured once in a
    CUDA graph and
    replayed for 200 steps (positions, slots and inputs updated in place between replays,
    groups completing along the way) gives the eager layer's outputs over caches of its own,
    step for step."""
    layer = _gpu_layer(kind, backend)
    table = torch.randn(4096, 64, device="cuda")
    b, ctx0, pages = 8, 1000, 24
    c_table = torch.randperm(512)[:b * 32].view(b, 32).int().cuda()
    w_table = torch.randperm(512)[:b * pages].view(b, pages).int().cuda()
    eager, graphed = _gpu_caches(layer, 512, b + 1), _gpu_caches(layer, 512, b + 1)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randn(b * ctx0, 1024, generator=g).cuda().to(torch.bfloat16)

    def step_for(ctx):
        pos = torch.full((b,), ctx, device="cuda")
        return dict(query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
                    seq_lens=(pos + 1).int(), block_table=w_table,
                    slot_mapping=w_table.long().gather(1, (pos // 64)[:, None])[:, 0] * 64
                    + pos % 64, compressed_block_table=c_table,
                    state_indices=torch.arange(b, dtype=torch.int32, device="cuda") + 1), pos

    prefill = dict(query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda") * ctx0,
                   seq_lens=torch.full((b,), ctx0, dtype=torch.int32, device="cuda"),
                   block_table=w_table, compressed_block_table=c_table,
                   state_indices=torch.arange(b, dtype=torch.int32, device="cuda") + 1)
    p = torch.arange(ctx0, device="cuda").repeat(b)
    r = torch.arange(b, device="cuda").repeat_interleave(ctx0)
    prefill["slot_mapping"] = w_table.long()[r, p // 64] * 64 + p % 64
    with torch.no_grad():
        for caches in (eager, graphed):
            layer(prompt, p, table, caches[0], prefill, *caches[1:])
        static_step, static_pos = step_for(ctx0)
        static_x = torch.zeros(b, 1024, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # (compiled and warm before the capture)
            layer(static_x, static_pos, table, graphed[0], static_step, *graphed[1:])
        for caches in (eager, graphed):  # (the warm-ups wrote: rerun the prompt on both)
            layer(prompt, p, table, caches[0], prefill, *caches[1:])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, static_pos, table, graphed[0], static_step,
                               *graphed[1:])
        for i in range(200):
            step, pos = step_for(ctx0 + i)
            x = torch.randn(b, 1024, generator=g).cuda().to(torch.bfloat16)
            static_x.copy_(x)
            static_pos.copy_(pos)
            for key, value in step.items():
                static_step[key].copy_(value)
            graph.replay()
            want = layer(x, pos, table, eager[0], step, *eager[1:])
            torch.testing.assert_close(static_out, want, atol=0, rtol=0)


def standin_flashmla_v4():
    """FlashMLA's sparse fp8 decode for V4 in torch, with its contract: q [b, 1, 64 | 128
    heads, 512] bf16; k_cache (and extra_k_cache) [blocks, page, 1, 584] e4m3 views of vLLM's
    planar pages; indices (and extra indices) [b, 1, a multiple of 64] int32 global slots, -1
    skipped and nothing else outside its cache; attn_sink [heads] fp32 in the denominator; no
    block table, lengths or topk_length; a schedule object set by its first call and valid for
    its shapes only."""
    import dataclasses as dc
    import types

    from attn_ops.backends.deepseek_v4.cache import read_entries

    mod = types.ModuleType("flash_mla")
    mod.calls = []

    @dc.dataclass
    class FlashMLASchedMeta:
        shape: tuple | None = None

    def entries(cache, idx):
        blocks, page = cache.shape[:2]
        assert cache.dtype == torch.float8_e4m3fn and cache.shape[2:] == (1, 584)
        assert idx.dtype == torch.int32 and idx.shape[2] % 64 == 0
        assert ((idx == -1) | ((idx >= 0) & (idx < blocks * page))).all()
        return read_entries(cache.view(torch.uint8).view(blocks, page * 584), page,
                            idx.clamp(min=0).flatten().long(), torch.float64).view(
                                *idx.shape, 512)

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, extra_k_cache=None,
                               extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None):
        b, s_q, heads, d = q.shape
        assert heads in (64, 128) and d == 512 and s_q == 1 and head_dim_v == 512
        assert q.dtype == torch.bfloat16 and attn_sink.dtype == torch.float32
        assert block_table is None and cache_seqlens is None and is_fp8_kvcache and not causal
        assert topk_length is None and extra_topk_length is None
        assert (extra_k_cache is None) == (extra_indices_in_kvcache is None)
        meta = tile_scheduler_metadata
        shape = (b, heads, indices.shape[2], None if extra_k_cache is None
                 else extra_indices_in_kvcache.shape[2])
        if meta.shape is None:
            meta.shape = shape
        assert meta.shape == shape
        mod.calls.append(b)
        keys, valid = entries(k_cache, indices), indices >= 0
        if extra_k_cache is not None:
            keys = torch.cat([keys, entries(extra_k_cache, extra_indices_in_kvcache)], 2)
            valid = torch.cat([valid, extra_indices_in_kvcache >= 0], 2)
        o = torch.zeros(b, 1, heads, 512, dtype=q.dtype)
        for r in range(b):
            kv = keys[r, 0][valid[r, 0]]
            if not len(kv):
                continue
            score = q[r, 0].double() @ kv.T * softmax_scale
            lse = torch.logsumexp(score, -1)
            denom = torch.logaddexp(lse, attn_sink.double())
            o[r, 0] = (torch.exp(score - denom[:, None]) @ kv).to(q.dtype)
        return o, torch.zeros(b, heads, 1)

    mod.FlashMLASchedMeta = FlashMLASchedMeta
    mod.get_mla_metadata = lambda *a, **k: (FlashMLASchedMeta(), None)
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod

@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("mode", ["window", "dense", "picks"])
def test_flashmla_index_lists_in_one_launch_are_the_torch_forms(mode):
    """DSV4_FLASHMLA's index lists built by one Triton launch equal the torch form's, entry for
    entry: decodes, a prefill, a chunk, padding rows; window pages released (-1), block ids
    past the cache or below -1, a table column never reached; picks with -1, repeats, entries
    not yet complete and past the compressed table."""
    from attn_ops.backends.deepseek_v4.flashmla import index_lists, index_lists_triton

    g = torch.Generator().manual_seed(8)
    reqs, window_len, ratio, page, cpage = ((23, 1), (7, 1), (0, 6), (9, 5), (25, 2)), 6, 4, 4, 2
    window, compressed, table, c_table = _paged_v4(reqs, 512, True, page, cpage, ratio, g)
    table = torch.cat([table, table], 1)  # (columns past every request's window: unread)
    new = torch.tensor([n for _, n in reqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).int()
    seq = torch.tensor([c + n for c, n in reqs]).int()
    t = int(qsl[-1]) + 2
    table[0, :2] = -1  # (released behind request 0's window)
    table[4, 5], table[4, 6] = 10 ** 6, -7  # (corrupt ids inside request 4's window)
    c_table[3, 1] = 10 ** 6
    c_table[1, 0] = -5
    picks = None
    if mode == "picks":
        picks = torch.randint(-1, 12, (t, 20), generator=g).int()
        picks[:, 3] = picks[:, 2]
    extra = ((compressed, c_table, ratio, picks) if mode != "window" else (None, None, 0, None))
    want = index_lists(qsl, seq, table, window, window_len, t, *extra)
    got = _on_device(index_lists_triton, qsl, seq, table, window, window_len, t, *extra)
    assert got[0].dtype == torch.int32 and torch.equal(got[0], want[0])
    assert (got[1] is None) == (want[1] is None) == (mode == "window")
    if mode != "window":
        assert got[1].dtype == torch.int32 and torch.equal(got[1], want[1])
        assert (want[1] >= 0).sum() > 10 and (want[1] == -1).sum() > 10
    assert (want[0] >= 0).sum() > 10 and (want[0][t - 2:] == -1).all()



@pytest.mark.parametrize("mode,heads", [("window", 3), ("dense", 3), ("picks", 3),
                                        ("picks", 64)])
def test_flashmla_glue_runs_what_the_reference_does(monkeypatch, mode, heads):
    """DSV4_FLASHMLA's glue (index lists built on the device, heads padded to 64 with -inf
    sinks -- 64 heads passed as they are, FlashMLA's output returned as the op's --, e4m3 page
    views, one schedule a shape) against a stand-in of FlashMLA's V4 decode
    with its call contract: the reference's outputs over the same 584-byte caches -- decodes,
    a prefill, a chunk, two padding rows, released window pages (-1), picks with -1, repeats
    and entries not yet complete, a block id outside the cache. Its selection: sm90 with a
    FlashMLA whose interface has V4's arguments, bf16 and fp8 entries only, each refusal
    naming why."""
    import dataclasses as dc
    import sys

    from attn_ops.backends.deepseek_v4.flashmla import (DeepseekV4FlashMLABackend,
                                                        flashmla_attention)
    from attn_ops.backends.deepseek_v4.reference import dsv4_attention_reference
    from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
    from attn_ops.platforms import Platform

    mod = standin_flashmla_v4()
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    g = torch.Generator().manual_seed(21)
    reqs, window_len, ratio, page, cpage = ((23, 1), (7, 1), (0, 6), (9, 5)), 6, 4, 4, 2
    window, compressed, table, c_table = _paged_v4(reqs, 512, True, page, cpage, ratio, g)
    new = torch.tensor([n for _, n in reqs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).int()
    seq = torch.tensor([c + n for c, n in reqs]).int()
    t = int(qsl[-1]) + 2
    q = torch.randn(t, heads, 512, generator=g).bfloat16()
    sinks = torch.randn(heads, generator=g)
    table[0, :2] = -1  # (released behind request 0's window)
    c_table[3, 7] = 10 ** 6  # (a column past request 3's entries: never read)
    picks = None
    if mode == "picks":
        picks = torch.randint(-1, 7, (t, 5), generator=g)
        picks[:, 3] = picks[:, 2]
    extra = (compressed, c_table, ratio, picks) if mode != "window" else (None, None, 0, None)
    got = flashmla_attention(q, window, qsl, seq, table, sinks, 512 ** -0.5, window_len,
                             *extra)
    want = dsv4_attention_reference(q[:t - 2].float(), window, qsl, seq, table, sinks,
                                    512 ** -0.5, window_len, *extra)
    torch.testing.assert_close(got[:t - 2].float(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(got[t - 2:], torch.zeros_like(got[t - 2:]))
    assert mod.calls == [t]
    h200 = dc.replace(Platform.parse("cuda:9.0"))
    spec = DeepseekV4Spec("compressed_sparse_attention", compress_ratio=4, index_heads=64,
                          index_head_dim=128, index_topk=512, kv_cache_dtype="fp8_ds_mla")
    assert DeepseekV4FlashMLABackend.not_supported_reasons(spec, h200) == []
    # (selected first where it serves the spec; rows in the model dtype are DSV4_TRITON's)
    from attn_ops import select_backend

    assert select_backend(spec, h200).backend == "DSV4_FLASHMLA"
    assert select_backend(dc.replace(spec, kv_cache_dtype="auto"), h200).backend == \
        "DSV4_TRITON"
    for bad, code in ((dc.replace(spec, kv_cache_dtype="auto"), "kv_cache_dtype"),
                      (dc.replace(spec, dtype=torch.float16), "dtype"),
                      (dc.replace(spec, num_heads=256), "num_heads")):
        assert [r.code for r in DeepseekV4FlashMLABackend.not_supported_reasons(bad, h200)] \
            == [code]
    assert "sm90" in DeepseekV4FlashMLABackend.not_supported_reasons(
        spec, Platform.parse("cuda:10.0"))[0].message
    mod.flash_mla_with_kvcache = lambda q, k_cache, *args, indices=None: None  # (V3.2's)
    reasons = DeepseekV4FlashMLABackend.not_supported_reasons(spec, h200)
    assert "has no attn_sink, extra_k_cache" in reasons[0].message
