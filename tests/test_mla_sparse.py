"""Sparse MLA: the selection-restricted absorbed attention against a naive dense fp64 MLA with
an explicit mask of the selected positions (NaN-poisoned pages in random order, -1 holes
anywhere in a token's slot list, tokens with nothing selected, padding rows), the full
selection against REFERENCE_MLA's dense layer, fp8 latents, selection and its reasons,
opcheck and torch.compile of the indexer + sparse layer chain."""

from __future__ import annotations

import math

import pytest
import torch

from attn_ops import (AttentionConfig, AttentionSpec, BlockAllocator, MLAAttention,
                      build_batch, get_backend_class)
from attn_ops.backends.mla.common import mla_cache_update
from attn_ops.backends.mla.indexer import indexer_slots
from attn_ops.platforms import current_platform
from attn_ops.registry import MLA_BACKENDS
from attn_ops.routing import FLASHMLA_MAX_ROWS
from attn_ops.selector import candidates_for, select_backend
from attn_ops.spec import KVCacheDType
from test_mla import StandinMLAWrapper, no_providers, simulated_h200  # noqa: F401 (fixture)

PAGE = 4
NUM_BLOCKS = 64
TOPK = 8
PLATFORM = current_platform()
DEVICE = PLATFORM.device_type
SPEC = AttentionSpec.mla(4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                         v_head_dim=12, dtype=torch.float32, block_size=PAGE, index_topk=TOPK)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-2}
SCENARIOS = {  # (context, new tokens) per request, decode-first
    "decode_only": [(9, 1), (17, 1), (2, 1)],
    "mixed": [(7, 1), (12, 1), (0, 6), (9, 21)],
    "speculative": [(10, 2), (6, 4), (20, 3), (0, 3)],
}
# every sparse MLA backend that runs here, with the widest dtype it runs: a new one enrolls
SPARSE_HERE = {}
for _b in sorted(MLA_BACKENDS, key=lambda b: b.value):
    for _dt in (torch.float64, torch.float32, torch.float16):
        if not get_backend_class(_b.value).not_supported_reasons(SPEC.with_(dtype=_dt),
                                                                 PLATFORM):
            SPARSE_HERE[_b.value] = _dt
            break


def _case(spec, reqs, *, seed=0, padded=2, device=DEVICE):
    """One step: the contexts already in a NaN-poisoned latent cache with pages in random
    order; fp64 latents, queries and weights; the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    h, nope, rank, v = spec.num_heads, spec.qk_nope_head_dim, spec.kv_lora_rank, spec.v_head_dim
    w = torch.randn(h * (nope + v), rank, generator=g, dtype=torch.float64) / rank ** 0.5
    fp8 = spec.kv_cache_dtype.is_fp8
    kv_scale = torch.full((1,), 0.05, device=device) if fp8 else None
    cache = torch.full((NUM_BLOCKS, PAGE, spec.latent_dim), float("nan"), dtype=torch.float64,
                       device=device).to(spec.cache_dtype if fp8 else torch.float64)
    alloc = BlockAllocator(NUM_BLOCKS, PAGE, shuffle=True, seed=seed)
    lat = [torch.randn(c + n, rank + spec.qk_rope_head_dim, generator=g, dtype=torch.float64)
           for c, n in reqs]
    with_ctx = [i for i, (c, _) in enumerate(reqs) if c]
    if with_ctx:
        pre = build_batch(alloc, with_ctx, [0] * len(with_ctx), [reqs[i][0] for i in with_ctx],
                          decode_threshold=0, device=device)
        rows = torch.cat([lat[i][:reqs[i][0]] for i in with_ctx]).to(device)
        mla_cache_update(rows[:, :rank], rows[:, rank:], cache, pre.slot_mapping, kv_scale)
    total = sum(n for _, n in reqs)
    meta = build_batch(alloc, list(range(len(reqs))), [c for c, _ in reqs], [n for _, n in reqs],
                       num_tokens_padded=total + padded, device=device, decode_threshold=4)
    q = torch.randn(total + padded, h, spec.head_dim, generator=g, dtype=torch.float64)
    q[total:] = 0
    new = torch.cat([lt[c:] for lt, (c, _) in zip(lat, reqs)])
    new = torch.cat([new, torch.zeros(padded, new.shape[1], dtype=new.dtype)])
    return dict(w=w, cache=cache, kv_scale=kv_scale, meta=meta, q=q, new=new, lat=lat,
                total=total)


def _selection(g, reqs, total, padded, topk, *, full=False):
    """Request-local positions [T, topk] per token: all it sees (``full``), or a random subset
    of what it sees of at most ``topk``, in random order with -1 holes anywhere; every fifth
    token selects nothing; padding rows select nothing."""
    rows = []
    for c, n in reqs:
        for i in range(n):
            p = c + i
            if full:
                assert p + 1 <= topk
                chosen = list(range(p + 1))
            elif len(rows) % 5 == 4:
                chosen = []
            else:
                k = int(torch.randint(1, min(topk, p + 1) + 1, (1,), generator=g))
                chosen = torch.randperm(p + 1, generator=g)[:k].tolist()
            row = chosen + [-1] * (topk - len(chosen))
            rows.append([row[j] for j in torch.randperm(topk, generator=g).tolist()])
    rows += [[-1] * topk] * padded
    return torch.tensor(rows, dtype=torch.int32)


def _masked_dense(spec, w, q, lat, reqs, positions, kv_scale):
    """Naive MLA per token, every key up-projected, over the positions it selected only (an
    explicit mask; nothing selected: 0); fp8: the latents the cache holds."""
    h, nope, v, rank = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    out, row = [], 0
    for lt, (c, n) in zip(lat, reqs):
        if kv_scale is not None:
            s = kv_scale.double().cpu()
            lt = (lt.float() / kv_scale.cpu()).clamp(-448, 448).to(spec.cache_dtype).double() * s
        kv = (lt[:, :rank] @ w.T).view(-1, h, nope + v)
        k = torch.cat([kv[..., :nope], lt[:, None, rank:].expand(-1, h, -1)], -1)
        for i in range(n):
            allowed = torch.zeros(lt.shape[0], dtype=torch.bool)
            sel = positions[row][positions[row] >= 0].long()
            allowed[sel] = True
            assert not allowed[c + i + 1:].any()  # (the selection is causal)
            score = torch.einsum("hd,jhd->hj", q[row], k) * spec.softmax_scale
            score = score.masked_fill(~allowed[None], -math.inf)
            probs = torch.softmax(score, -1).nan_to_num(0.0)
            out.append(torch.einsum("hj,jhd->hd", probs, kv[..., nope:]))
            row += 1
    return torch.stack(out)


def _layer(spec, case, backend, dtype, tuning=None):
    spec = spec.with_(dtype=dtype)
    layer = MLAAttention(spec, AttentionConfig(backend=backend, tuning=tuning)).to(DEVICE)
    assert layer.impl.name == backend
    layer.load_kv_b_proj(case["w"].to(dtype))
    if case["kv_scale"] is not None:
        layer.kv_scale.copy_(case["kv_scale"])
    cache = case["cache"].clone() if spec.kv_cache_dtype.is_fp8 else case["cache"].to(dtype)
    return layer, cache


def _run(spec, case, backend, dtype, slots, tuning=None):
    layer, cache = _layer(spec, case, backend, dtype, tuning)
    rank = spec.kv_lora_rank
    new = case["new"].to(DEVICE, dtype)
    return layer(case["q"].to(DEVICE, dtype), new[:, :rank], new[:, rank:], cache, case["meta"],
                 topk_slots=slots)


def _slots(positions, meta):
    return indexer_slots(positions.to(meta.block_table.device), meta.block_table,
                         meta.query_start_loc, PAGE)


@pytest.mark.parametrize("backend", SPARSE_HERE)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("heads", [4, 20])
def test_sparse_layer_matches_dense_mla_masked_to_the_selection(backend, scenario, heads):
    """20 heads: two 16-head blocks of TRITON_MLA_SPARSE, the last partial."""
    from attn_ops.tuning import Tuning

    _check_against_masked_dense(SPEC.with_(num_heads=heads), SCENARIOS[scenario], backend,
                                Tuning().with_(mla={"sparse_heads": 16}), case_seed=heads,
                                selection_seed=1, padded=2)


def _check_against_masked_dense(spec, reqs, backend, tuning, *, case_seed, selection_seed,
                                padded):
    """``backend``'s sparse layer over a step of ``reqs`` and a random selection (every
    padding row zero) against dense MLA masked to that selection, at its dtype's tolerance."""
    case = _case(spec, reqs, seed=case_seed, padded=padded)
    positions = _selection(torch.Generator().manual_seed(selection_seed), reqs, case["total"],
                           padded, TOPK)
    dtype = SPARSE_HERE[backend]
    got = _run(spec, case, backend, dtype, _slots(positions, case["meta"]), tuning)
    want = _masked_dense(spec, case["w"], case["q"], case["lat"], reqs, positions, None)
    t = case["total"]
    assert (got[t:] == 0).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[:t].double().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", SPARSE_HERE)
@pytest.mark.parametrize("seed", range(2))
def test_sparse_layer_matches_dense_mla_on_random_steps(backend, seed):
    """A step drawn at random (head count, requests with and without context, decodes and
    speculative or prefill rows, padding, head blocks and splits of the kernel) against dense
    MLA masked to a random selection."""
    import random

    from attn_ops.tuning import Tuning

    rng = random.Random(f"{backend}-{seed}")
    heads = rng.choice([1, 4, 20, 33])
    reqs = sorted(((rng.choice([0, rng.randint(1, 40)]), rng.choice([1, 2, 4, rng.randint(5, 20)]))
                   for _ in range(rng.randint(1, 4))), key=lambda r: r[1] > 4)
    padded = rng.choice([0, 2])
    tuning = Tuning().with_(mla={"sparse_heads": rng.choice([16, 32, 64]),
                                 "sparse_splits": rng.choice([0, 1, 3])})
    _check_against_masked_dense(SPEC.with_(num_heads=heads), reqs, backend, tuning,
                                case_seed=seed, selection_seed=seed, padded=padded)


@pytest.mark.skipif("TRITON_MLA_SPARSE" not in SPARSE_HERE, reason="needs Triton here")
@pytest.mark.parametrize("splits,cache", [(3, "auto"), (2, "fp8_e4m3"), (4, "auto")])
def test_triton_sparse_splits_of_the_slots_combine_to_the_same_attention(splits, cache):
    """TRITON_MLA_SPARSE with each token's 64 slot entries (selections spread over them, -1
    holes between) in ``splits`` programs of 16-slot steps -- 3: splits of 32, 32 and none;
    4: of 16 each -- merged by the split combine; 20 heads (two head blocks), fp8 latents in
    one case."""
    from attn_ops.tuning import Tuning

    spec = SPEC.with_(num_heads=20, kv_cache_dtype=KVCacheDType(cache), index_topk=64)
    reqs = SCENARIOS["mixed"]
    case = _case(spec, reqs, seed=splits)
    positions = _selection(torch.Generator().manual_seed(4), reqs, case["total"], 2, 64)
    tuning = Tuning().with_(mla={"sparse_splits": splits, "sparse_keys": 16, "sparse_heads": 16})
    got = _run(spec, case, "TRITON_MLA_SPARSE", torch.float32, _slots(positions, case["meta"]),
               tuning)
    want = _masked_dense(spec, case["w"], case["q"], case["lat"], reqs, positions,
                         case["kv_scale"])
    assert (got[case["total"]:] == 0).all()
    tol = 1e-4 if cache == "fp8_e4m3" else 2e-5
    torch.testing.assert_close(got[:case["total"]].double().cpu(), want, atol=tol, rtol=tol)


def test_sparse_splits_fill_the_sms_for_few_tokens_and_none_for_many():
    from attn_ops.routing import sparse_mla_splits
    from attn_ops.tuning import Tuning

    t = Tuning().mla
    assert sparse_mla_splits(8, 128, 2048, 132, t) == 8  # (8 x 2 programs; 264 wanted)
    assert sparse_mla_splits(64, 128, 2048, 132, t) == 2
    assert sparse_mla_splits(1, 128, 2048, 132, t) == 8  # (at least 256 slots a split)
    assert sparse_mla_splits(128, 128, 2048, 132, t) == 1
    assert sparse_mla_splits(1, 16, 2048, 132, t) == 8
    assert sparse_mla_splits(4, 16, 300, 132, t) == 1  # (one split's worth of slots)
    assert sparse_mla_splits(1, 128, 2048, 132, Tuning().with_(
        mla={"sparse_splits": 3}).mla) == 3


@pytest.mark.parametrize("backend", SPARSE_HERE)
def test_fp8_latents_match_the_dense_mla_of_what_the_cache_holds(backend):
    spec = SPEC.with_(kv_cache_dtype=KVCacheDType.FP8_E4M3)
    reqs = SCENARIOS["mixed"]
    case = _case(spec, reqs, seed=3)
    positions = _selection(torch.Generator().manual_seed(2), reqs, case["total"], 2, TOPK)
    got = _run(spec, case, backend, SPARSE_HERE[backend], _slots(positions, case["meta"]))
    want = _masked_dense(spec, case["w"], case["q"], case["lat"], reqs, positions,
                         case["kv_scale"])
    torch.testing.assert_close(got[:case["total"]].double().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", SPARSE_HERE)
def test_selecting_everything_a_token_sees_is_reference_mlas_dense_layer(backend):
    spec = SPEC.with_(index_topk=32)
    reqs = SCENARIOS["speculative"]  # (every token sees at most 23 positions)
    case = _case(spec, reqs, seed=5)
    positions = _selection(None, reqs, case["total"], 2, 32, full=True)
    got = _run(spec, case, backend, torch.float32, _slots(positions, case["meta"]))
    dense = spec.with_(index_topk=None, dtype=torch.float32)
    layer, cache = _layer(dense, case, "REFERENCE_MLA", torch.float32)
    new = case["new"].to(DEVICE, torch.float32)
    want = layer(case["q"].to(DEVICE, torch.float32), new[:, :32], new[:, 32:], cache,
                 case["meta"])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_sparse_specs_select_sparse_backends_and_each_rejection_says_why():
    sparse = {c.name: c for c in candidates_for(SPEC, PLATFORM)}
    assert select_backend(SPEC, PLATFORM).backend in SPARSE_HERE
    for dense in ("REFERENCE_MLA", "TRITON_MLA", "FLASHINFER_MLA"):
        assert any(r.code == "feature" or "sparse_mla" in str(r)
                   for r in sparse[dense].reasons), dense
    assert any("FlashMLA's sparse MLA takes latents of 512 + 64" in str(r)
               and "TRITON_MLA_SPARSE" in str(r) for r in sparse["FLASHMLA_SPARSE"].reasons)
    dense = {c.name: c for c in candidates_for(SPEC.with_(index_topk=None), PLATFORM)}
    for name in ("REFERENCE_MLA_SPARSE", "TRITON_MLA_SPARSE", "FLASHMLA_SPARSE"):
        assert any("serves sparse MLA layers only" in str(r) for r in dense[name].reasons)
    with pytest.raises(ValueError, match="index_topk=8 needs an MLA spec"):
        AttentionSpec(num_heads=4, head_dim=16, index_topk=8)
    with pytest.raises(ValueError, match="index_topk=0 must be a positive int"):
        SPEC.with_(index_topk=0)


def _corrupt(slots, capacity, g):
    """The same selection as ``slots`` with its -1 entries turned into other entries every
    sparse backend must skip: slots past the cache (its capacity, far past it), negative ones,
    and each row's order shuffled."""
    out = slots.clone().cpu().long()
    junk = torch.tensor([capacity, capacity + 7, 2 ** 30, -5, -1, -(2 ** 30)])
    holes = out < 0
    out[holes] = junk[torch.randint(0, junk.numel(), (int(holes.sum()),), generator=g)]
    for r in range(out.shape[0]):
        out[r] = out[r, torch.randperm(out.shape[1], generator=g)]
    return out.to(torch.int32).to(slots.device)


@pytest.mark.parametrize("backend", SPARSE_HERE)
@pytest.mark.parametrize("scenario", ["mixed", "decode_only"])
def test_every_sparse_backend_skips_out_of_range_and_padding_entries_anywhere(backend,
                                                                             scenario):
    """One selection contract: entries outside the cache (past its end, far past it,
    negative) and -1 anywhere in a row are skipped, never read -- the output equals the clean
    selection's and the masked dense MLA; with debug checks on, the first such entry raises."""
    from attn_ops import set_debug_checks

    reqs = SCENARIOS[scenario]
    case = _case(SPEC, reqs, seed=5)
    positions = _selection(torch.Generator().manual_seed(6), reqs, case["total"], 2, TOPK)
    dtype = SPARSE_HERE[backend]
    clean = _slots(positions, case["meta"])
    bad = _corrupt(clean, NUM_BLOCKS * PAGE, torch.Generator().manual_seed(7))
    assert ((bad >= NUM_BLOCKS * PAGE) | (bad < -1)).any()
    got = _run(SPEC, case, backend, dtype, bad)
    torch.testing.assert_close(got, _run(SPEC, case, backend, dtype, clean),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    want = _masked_dense(SPEC, case["w"], case["q"], case["lat"], reqs, positions, None)
    t = case["total"]
    assert torch.isfinite(got).all() and (got[t:] == 0).all()
    torch.testing.assert_close(got[:t].double().cpu(), want, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match=r"topk_slots\[\d+, \d+\]=-?\d+ is outside the "
                           r"latent cache's slots 0\.\.255"):
            _run(SPEC, case, backend, dtype, bad)
        _run(SPEC, case, backend, dtype, clean)  # (-1 padding is not an offender)
    finally:
        set_debug_checks(False)


def test_bad_slot_inputs_name_the_shape_and_the_fix():
    case = _case(SPEC, SCENARIOS["decode_only"])
    backend = next(iter(SPARSE_HERE))
    layer, cache = _layer(SPEC, case, backend, SPARSE_HERE[backend])
    q = case["q"].to(DEVICE, SPARSE_HERE[backend])
    new = case["new"].to(DEVICE, q.dtype)
    args = (q, new[:, :32], new[:, 32:], cache, case["meta"])
    with pytest.raises(ValueError, match=r"needs topk_slots \[5, 8\] \(MLAIndexer's slots\)"):
        layer(*args)
    with pytest.raises(ValueError, match=r"needs topk_slots \[5, 8\]"):
        layer(*args, topk_slots=torch.zeros(5, 4, dtype=torch.int32, device=DEVICE))
    dense, cache_d = _layer(SPEC.with_(index_topk=None), case, "REFERENCE_MLA", q.dtype)
    with pytest.raises(ValueError, match="topk_slots given to a dense MLA layer"):
        dense(q, new[:, :32], new[:, 32:], cache_d, case["meta"],
              topk_slots=torch.zeros(5, 8, dtype=torch.int32, device=DEVICE))
    from attn_ops.layers.mla_indexer import MLAIndexer

    indexer = MLAIndexer(24, 20, num_heads=2, head_dim=16, rope_dim=8, topk=TOPK)
    keys, scales = indexer.allocate_cache(NUM_BLOCKS, 2 * PAGE, torch.float32)
    with pytest.raises(ValueError, match=r"index-key cache has pages of 8 tokens, the block "
                       r"table 4.*MLAIndexer.allocate_cache\(num_blocks, 4\)"):
        indexer(torch.zeros(5, 24), torch.zeros(5, 20), torch.ones(5, 8), torch.zeros(5, 8),
                keys, scales, case["meta"].slot_mapping, case["meta"].block_table,
                case["meta"].seq_lens, case["meta"].query_start_loc, block_size=layer.block_size)
    op = layer.impl.op
    out = q.new_empty(5, 4, 12)
    with pytest.raises(ValueError, match=r"topk_slots must be int32 \[num_tokens=5, topk\]"):
        op(q, cache, layer.w_uk, layer.w_uv, torch.zeros(5, 8, device=DEVICE), out, None, 0.1,
           [16, 32, 4, 2, 1])


@pytest.mark.parametrize("backend", SPARSE_HERE)
def test_sparse_op_passes_opcheck(backend):
    reqs = SCENARIOS["mixed"]
    case = _case(SPEC, reqs)
    dtype = SPARSE_HERE[backend]
    layer, cache = _layer(SPEC, case, backend, dtype)
    positions = _selection(torch.Generator().manual_seed(0), reqs, case["total"], 2, TOPK)
    q = case["q"].to(DEVICE, dtype)
    out = q.new_empty(q.shape[0], 4, 12)
    torch.library.opcheck(layer.impl.op, (q, cache, layer.w_uk, layer.w_uv,
                                          _slots(positions, case["meta"]), out, None, 0.1,
                                          [16, 32, 4, 2, 1]))


@pytest.mark.parametrize("backend", SPARSE_HERE)
def test_indexer_then_sparse_layer_compiles_with_no_graph_break(backend):
    """MLAIndexer (index-key write, top-k, slots) then the sparse layer (latent write,
    attention), one compiled fullgraph function, equal to eager."""
    from attn_ops.layers.mla_indexer import MLAIndexer

    dtype = torch.float32  # (the index-key cache's widest dtype)
    reqs = SCENARIOS["mixed"]
    case = _case(SPEC, reqs)
    meta = case["meta"]
    g = torch.Generator().manual_seed(9)
    hidden, q_lora, rope = 24, 20, SPEC.qk_rope_head_dim
    indexer = MLAIndexer(hidden, q_lora, num_heads=2, head_dim=16, rope_dim=rope,
                         topk=TOPK).to(DEVICE, dtype)
    for p in indexer.parameters():
        p.data = torch.randn(p.shape, generator=g).to(p)
    t = case["q"].shape[0]
    x = torch.randn(t, hidden, generator=g).to(DEVICE, dtype)
    q_resid = torch.randn(t, q_lora, generator=g).to(DEVICE, dtype)
    angle = torch.randn(t, rope // 2, generator=g).repeat(1, 2)
    cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
    layer, cache = _layer(SPEC, case, backend, dtype)
    rank = SPEC.kv_lora_rank
    new = case["new"].to(DEVICE, dtype)
    q = case["q"].to(DEVICE, dtype)

    def step(keys, cache):
        _, slots = indexer(x, q_resid, cos, sin, keys, None, meta.slot_mapping,
                           meta.block_table, meta.seq_lens, meta.query_start_loc,
                           block_size=PAGE)
        return layer(q, new[:, :rank], new[:, rank:], cache, meta, topk_slots=slots), slots

    from attn_ops.backends.mla.indexer import allocate_index_cache

    keys, _ = allocate_index_cache(NUM_BLOCKS, PAGE, 16, dtype, device=DEVICE)
    want, want_slots = step(keys.clone(), cache.clone())
    torch._dynamo.reset()
    got, got_slots = torch.compile(step, fullgraph=True)(keys.clone(), cache.clone())
    assert torch.equal(got_slots, want_slots)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want_slots[case["total"]:] == -1).all()


@pytest.mark.parametrize("backend", SPARSE_HERE)
def test_hf_deepseek_v32_attention_is_reproduced_over_prefill_chunks_and_decode(backend):
    """HF's ``DeepseekV32Attention`` (small random config, fp32, eager: the indexer's
    selection folded into its mask) over each request's whole sequence, against its
    projections run around MLAIndexer and the sparse layer over a paged cache in three steps
    -- a prefill, a prefill resuming mid-prompt, a decode -- every token's output compared
    (top-k 6 of up to 23 positions: the selection is sparse). 8 index heads: with 2, some
    tokens' scores tie at exactly 0 (every ReLU term zero) across the top-k boundary, where
    HF's torch.topk picks any of them and ours the lower positions."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Attention, DeepseekV32RotaryEmbedding)

    from attn_ops.backends.mla.indexer import allocate_index_cache
    from attn_ops.layers.mla_indexer import MLAIndexer

    torch.manual_seed(6)
    heads, nope, rope, rank, v, topk = 4, 16, 8, 32, 12, 6
    cfg = DeepseekV32Config(hidden_size=48, num_attention_heads=heads, num_key_value_heads=heads,
                            q_lora_rank=24, kv_lora_rank=rank, qk_nope_head_dim=nope,
                            qk_rope_head_dim=rope, v_head_dim=v, index_n_heads=8,
                            index_head_dim=16, index_topk=topk)
    cfg._attn_implementation = "eager"
    hf = DeepseekV32Attention(cfg, 0).eval()
    rotary = DeepseekV32RotaryEmbedding(cfg)
    lens, steps = [23, 14], [(15, 6), (7, 7), (1, 1)]
    xs = [torch.randn(n, 48) for n in lens]
    want = []
    for x in xs:
        n = x.shape[0]
        cos, sin = rotary(x[None], torch.arange(n)[None])
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        with torch.no_grad():
            want.append(hf(x[None], (cos, sin), mask, position_ids=torch.arange(n)[None])[0][0])

    spec = AttentionSpec.mla(heads, kv_lora_rank=rank, qk_nope_head_dim=nope,
                             qk_rope_head_dim=rope, v_head_dim=v, dtype=torch.float32,
                             block_size=PAGE, index_topk=topk)
    layer = MLAAttention(spec, AttentionConfig(backend=backend)).to(DEVICE)
    layer.load_kv_b_proj(hf.kv_b_proj.weight.detach().to(DEVICE))
    indexer = MLAIndexer(48, 24, num_heads=8, head_dim=16, rope_dim=rope, topk=topk)
    indexer.load_state_dict(hf.indexer.state_dict())
    hf.to(DEVICE)
    indexer.to(DEVICE)
    latent = layer.allocate_cache(NUM_BLOCKS)
    keys, _ = allocate_index_cache(NUM_BLOCKS, PAGE, 16, torch.float32, device=DEVICE)
    alloc = BlockAllocator(NUM_BLOCKS, PAGE, shuffle=True, seed=1)

    def half(y, cos, sin):  # half-split RoPE on [even | odd] channels: HF's interleaved RoPE
        y = torch.cat([y[..., 0::2], y[..., 1::2]], -1)
        a, b = y.chunk(2, -1)
        return y * cos + torch.cat([-b, a], -1) * sin

    done, got = [0, 0], [[], []]
    for new in steps:
        pos = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new)])
        x = torch.cat([xs[r][done[r]:done[r] + n] for r, n in enumerate(new)]).to(DEVICE)
        meta = build_batch(alloc, [0, 1], list(done), list(new), device=DEVICE)
        cos, sin = (c[0].to(DEVICE) for c in rotary(x[None].cpu(), pos[None]))
        with torch.no_grad():
            q_resid = hf.q_a_layernorm(hf.q_a_proj(x))
            q = hf.q_b_proj(q_resid).view(-1, heads, nope + rope)
            kv_pass, k_rot = hf.kv_a_proj_with_mqa(x).split([rank, rope], -1)
            q = torch.cat([q[..., :nope], half(q[..., nope:], cos[:, None], sin[:, None])], -1)
            _, slots = indexer(x, q_resid, cos, sin, keys, None, meta.slot_mapping,
                               meta.block_table, meta.seq_lens, meta.query_start_loc,
                               block_size=PAGE)
            out = layer(q, hf.kv_a_layernorm(kv_pass), half(k_rot, cos, sin), latent, meta,
                        topk_slots=slots)
            out = hf.o_proj(out.reshape(out.shape[0], -1)).cpu()
        first = 0
        for r, n in enumerate(new):
            got[r].append(out[first:first + n])
            first += n
            done[r] += n
    for r in range(2):
        torch.testing.assert_close(torch.cat(got[r]), want[r], atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3"])
def test_real_sizes_replay_in_cuda_graphs_as_eager(cache):
    """DeepSeek-V3.2 sizes: 128 heads, 512 + 64 latent, QK 192 / V 128; the indexer's 64
    heads x 128, top-k 2048; page 64, bf16 (fp8 latents and index keys: the fp8 case). One
    step of 8 decodes at contexts of 100 to 9000 tokens (sparse above 2048) through MLAIndexer
    and TRITON_MLA_SPARSE: eager against REFERENCE_MLA_SPARSE in fp32 on the same selection,
    then the step captured in a CUDA graph and replayed over 20 random batches of the same
    shape, each against eager on copies of the caches."""
    from attn_ops.backends.mla.indexer import FP8
    from attn_ops.backends.mla.sparse import sparse_mla_torch
    from attn_ops.layers.mla_indexer import MLAIndexer
    from attn_ops.testing import capture_graph

    torch.manual_seed(0)
    dev, dt, page, batch, blocks = "cuda", torch.bfloat16, 64, 8, 8 * 150
    fp8 = cache == "fp8_e4m3"
    spec = AttentionSpec.mla(128, dtype=dt, block_size=page, index_topk=2048,
                             kv_cache_dtype=KVCacheDType.FP8_E4M3 if fp8 else
                             KVCacheDType.AUTO)
    layer = MLAAttention(spec, AttentionConfig(backend="TRITON_MLA_SPARSE")).to(dev)
    layer.load_kv_b_proj((torch.randn(128 * 256, 512) / 512 ** 0.5).to(dev, dt))
    if fp8:
        layer.kv_scale.fill_(0.05)
    indexer = MLAIndexer(1024, 256, num_heads=64, head_dim=128, rope_dim=64,
                         topk=2048).to(dev, dt)
    latent = layer.allocate_cache(blocks, dev)
    latent.copy_((torch.randn(latent.shape, device=dev) * (20 if fp8 else 1)).to(latent.dtype))
    keys, scales = indexer.allocate_cache(blocks, page, FP8 if fp8 else dt, device=dev)
    keys.copy_(torch.randn(keys.shape, device=dev).to(keys.dtype))
    if scales is not None:
        scales.fill_(0.1)
    table = torch.randperm(blocks, device=dev).view(batch, -1).to(torch.int32)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)

    def batch_inputs():
        seq = torch.randint(100, 9000, (batch,), device=dev, dtype=torch.int32)
        slot = (table[torch.arange(batch, device=dev), (seq - 1) // page].long() * page
                + (seq - 1) % page)
        return dict(x=torch.randn(batch, 1024, device=dev, dtype=dt),
                    q_resid=torch.randn(batch, 256, device=dev, dtype=dt),
                    q=torch.randn(batch, 128, 192, device=dev, dtype=dt),
                    kv_c=torch.randn(batch, 512, device=dev, dtype=dt),
                    k_pe=torch.randn(batch, 64, device=dev, dtype=dt),
                    angle=torch.randn(batch, 32, device=dev).repeat(1, 2),
                    seq_lens=seq, slot_mapping=slot)

    def step(inp, latent, keys, scales):
        meta = SimpleNs(inp, table, qsl)
        cos, sin = inp["angle"].cos().to(dt), inp["angle"].sin().to(dt)
        _, slots = indexer(inp["x"], inp["q_resid"], cos, sin, keys, scales,
                           meta.slot_mapping, table, meta.seq_lens, qsl)
        out = layer(inp["q"], inp["kv_c"], inp["k_pe"], latent, meta, topk_slots=slots)
        return out, slots

    with torch.no_grad():
        first = batch_inputs()
        out, slots = step(first, latent.clone(), keys.clone(),
                          scales.clone() if scales is not None else None)
        assert ((slots >= 0).sum(1) == first["seq_lens"].clamp(max=2048)).all()
        # the attention alone against the reference, on the caches the step wrote
        lat2 = latent.clone()
        layer(first["q"], first["kv_c"], first["k_pe"], lat2, SimpleNs(first, table, qsl),
              topk_slots=slots)
        nope = first["q"][..., :128].transpose(0, 1)
        ql = torch.bmm(nope.float(), layer.w_uk.float()).transpose(0, 1)
        ref = torch.empty(batch, 128, 512, device=dev)
        sparse_mla_torch(ql, first["q"][..., 128:].float(), lat2, slots, ref,
                         layer.kv_scale, spec.softmax_scale)
        ref = torch.bmm(ref.transpose(0, 1), layer.w_uv.float()).transpose(0, 1)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, err

        static = batch_inputs()
        caches = (latent.clone(), keys.clone(), scales.clone() if scales is not None else None)
        graph, (g_out, g_slots) = capture_graph(lambda: step(static, *caches))
        for _ in range(20):
            new = batch_inputs()
            for name, value in new.items():
                static[name].copy_(value)
            before = tuple(c.clone() if c is not None else None for c in caches)
            graph.replay()
            want, want_slots = step(new, *before)
            assert torch.equal(g_slots, want_slots)
            torch.testing.assert_close(g_out, want, atol=1e-3, rtol=1.6e-2)


class SimpleNs:
    """A step's metadata fields the sparse layer and indexer read (the GPU test's batches)."""

    def __init__(self, inp, table, qsl):
        self.slot_mapping, self.block_table = inp["slot_mapping"], table
        self.seq_lens, self.query_start_loc = inp["seq_lens"], qsl


# --- FLASHINFER_MLA_SPARSE's glue against a stand-in of FlashInfer's wrapper ---------------------

class _StandinSparseWrapper(StandinMLAWrapper):
    """FlashInfer's MLA wrapper as test_mla's stand-in models it (plan arrays on the host,
    ``kv_indices`` read at run), planned the way the sparse glue must: pages of one token,
    not causal."""

    def plan(self, *args):
        page_size, causal = args[7], args[8]
        assert page_size == 1 and not causal
        super().plan(*args)


@pytest.fixture
def standin_flashinfer_sparse(monkeypatch):
    return simulated_h200(monkeypatch, _StandinSparseWrapper)


FI_SPEC = AttentionSpec.mla(4, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=64,
                            v_head_dim=12, dtype=torch.float16, block_size=PAGE,
                            index_topk=TOPK)


def _indexer_layout(g, reqs, padded, topk):
    """Positions as the indexer gives them: each token's min(topk, position + 1) selected
    positions ascending, then -1."""
    rows = []
    for c, n in reqs:
        for i in range(n):
            p = c + i
            chosen = sorted(torch.randperm(p + 1, generator=g)[:min(topk, p + 1)].tolist())
            rows.append(chosen + [-1] * (topk - len(chosen)))
    return torch.tensor(rows + [[-1] * topk] * padded, dtype=torch.int32)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_flashinfer_sparse_plans_the_selection_counts_and_runs_the_masked_dense_mla(
        standin_flashinfer_sparse, scenario):
    """Our side of FLASHINFER_MLA_SPARSE: per-token counts planned on the host, the index
    buffer filled on the device after the plan, the cache as pages of one token, padding rows
    zeroed -- against dense MLA masked to the selection."""
    reqs = SCENARIOS[scenario]
    case = _case(FI_SPEC, reqs, seed=2, device="cpu")  # (the stand-in runs on the host)
    positions = _indexer_layout(torch.Generator().manual_seed(3), reqs, 2, TOPK)
    layer = MLAAttention(FI_SPEC, AttentionConfig(backend="FLASHINFER_MLA_SPARSE"),
                         platform=standin_flashinfer_sparse)
    layer.load_kv_b_proj(case["w"].half())
    new = case["new"].half()
    got = layer(case["q"].half(), new[:, :128], new[:, 128:], case["cache"].half(),
                case["meta"], topk_slots=_slots(positions, case["meta"]))
    want = _masked_dense(FI_SPEC, case["w"], case["q"], case["lat"], reqs, positions, None)
    t = case["total"]
    assert (got[t:] == 0).all()
    torch.testing.assert_close(got[:t].double(), want, atol=2e-2, rtol=2e-2)


def test_flashinfer_sparse_repairs_rows_whose_entries_are_not_the_indexer_layout(
        standin_flashinfer_sparse):
    """FlashInfer reads every planned entry: a row with -1 or an out-of-range slot among its
    first ``min(topk, position + 1)`` entries, a valid one after them, or nothing valid is
    flagged by the packing and recomputed, so FLASHINFER_MLA_SPARSE gives what every other
    sparse backend gives for the same tensor."""
    reqs = SCENARIOS["mixed"]
    case = _case(FI_SPEC, reqs, seed=4, device="cpu")
    positions = _selection(torch.Generator().manual_seed(8), reqs, case["total"], 2, TOPK)
    slots = _corrupt(_slots(positions, case["meta"]), NUM_BLOCKS * PAGE,
                     torch.Generator().manual_seed(9))
    layer = MLAAttention(FI_SPEC, AttentionConfig(backend="FLASHINFER_MLA_SPARSE"),
                         platform=standin_flashinfer_sparse)
    layer.load_kv_b_proj(case["w"].half())
    new = case["new"].half()
    got = layer(case["q"].half(), new[:, :128], new[:, 128:], case["cache"].half(),
                case["meta"], topk_slots=slots)
    want = _masked_dense(FI_SPEC, case["w"], case["q"], case["lat"], reqs, positions, None)
    t = case["total"]
    assert torch.isfinite(got).all() and (got[t:] == 0).all()
    torch.testing.assert_close(got[:t].double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
def test_selection_packing_in_one_launch_equals_its_torch_definition():
    """The packing FLASHINFER_MLA_SPARSE runs before its kernel against its torch body: each
    row's first ``count`` entries packed at its offset (invalid ones as slot 0), and the
    flags of rows whose packed entries are not their selection."""
    from attn_ops.backends.mla.sparse_kernels import pack_selection, pack_selection_torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    rows, topk, capacity = 37, 1500, 5000
    slots = torch.randint(-3, capacity + 3, (rows, topk), generator=g, dtype=torch.int32)
    counts = torch.randint(0, topk + 1, (rows,), generator=g, dtype=torch.int32)
    for r in range(0, rows, 3):  # (the indexer's layout: count valid entries, -1 after)
        slots[r, :counts[r]] = torch.randint(0, capacity, (int(counts[r]),), generator=g)
        slots[r, counts[r]:] = -1
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.long().cumsum(0)[:-1]])
    got = [torch.full((int(counts.sum()),), -7, dtype=torch.int32, device=dev),
           torch.full((rows,), -7, dtype=torch.int32, device=dev)]
    want = [x.clone() for x in got]
    args = (slots.to(dev), counts.to(dev), indptr.to(torch.int32).to(dev))
    pack_selection(*args, *got, capacity)
    pack_selection_torch(*args, *want, capacity)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[0] >= 0).all() and (got[0] < capacity).all()
    assert (got[1][::3] == 0).all() and got[1].sum() > 0


def test_flashinfer_sparse_graph_plans_one_wrapper_per_capture_size(standin_flashinfer_sparse,
                                                                    monkeypatch):
    """The graph path's metadata, run eagerly: a wrapper per capture size over persistent
    buffers (the index buffer its own), replanned per batch; padding rows zeroed."""
    from attn_ops import build_step_metadata, platforms
    from attn_ops.cudagraph import CUDAGraphBatch

    monkeypatch.setattr(platforms, "current_platform", lambda: standin_flashinfer_sparse)
    graphs = CUDAGraphBatch((2, 8), 12, PAGE, "cpu")
    layer = MLAAttention(FI_SPEC, AttentionConfig(backend="FLASHINFER_MLA_SPARSE"),
                         platform=standin_flashinfer_sparse)
    oracle = MLAAttention(FI_SPEC.with_(dtype=torch.float32),
                          AttentionConfig(backend="REFERENCE_MLA_SPARSE"))
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4 * 28, 128, generator=g) / 128 ** 0.5
    layer.load_kv_b_proj(w.half())
    oracle.load_kv_b_proj(w.half().float())
    cache = torch.randn(NUM_BLOCKS, PAGE, 192, generator=g).half()
    alloc = BlockAllocator(NUM_BLOCKS, PAGE, shuffle=True, seed=3)
    handles = set()
    for n, ctx in ((5, [3, 9, 1, 20, 7]), (2, [4, 11]), (7, [2] * 7)):
        common = build_batch(alloc, list(range(10 * n, 11 * n)), ctx, [1] * n)
        step = build_step_metadata(layer, common, graphs)
        meta = step[layer._metadata_key]
        handles.add(meta.launch)
        size = graphs.size_for(n)
        reqs = [(c, 1) for c in ctx]
        positions = _indexer_layout(g, reqs, size - n, TOPK)
        slots = _slots(positions, meta)
        q = torch.randn(size, 4, 80, generator=g).half()
        kv_c = torch.randn(size, 128, generator=g).half()
        k_pe = torch.randn(size, 64, generator=g).half()
        got = layer(q, kv_c, k_pe, cache.clone(), step, topk_slots=slots)
        want = oracle(q[:n].float(), kv_c[:n].float(), k_pe[:n].float(), cache.clone().float(),
                      common, topk_slots=slots[:n])
        torch.testing.assert_close(got[:n].float(), want, atol=2e-2, rtol=2e-2)
        assert (got[n:] == 0).all()
        for r in range(n):
            alloc.free(10 * n + r)
    assert len(handles) == 2  # one wrapper per capture size


@pytest.mark.parametrize("backend", SPARSE_HERE)
def test_sparse_tiny_deepseek_reproduces_hf_deepseek_v32_for_causal_lm(backend):
    """The whole sparse decoder: HF's DeepseekV32ForCausalLM (dense MLPs, eager, fp32) loaded
    into TinyDeepseek with index_topk; a prefill of two requests, a prefill resuming
    mid-prompt, then a decode, through our paged latent and index-key caches (fp32 keys),
    against HF's logits over each whole sequence (top-k 5 of up to 17 positions)."""
    transformers = pytest.importorskip("transformers")
    from attn_ops.models.deepseek import MLAModelConfig, TinyDeepseek, load_hf_deepseek

    hf_cfg = transformers.DeepseekV32Config(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=8,
        index_head_dim=16, index_topk=5, mlp_layer_types=["dense", "dense"],
        first_k_dense_replace=2, max_position_embeddings=64)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.DeepseekV32ForCausalLM(hf_cfg).eval()
    cfg = MLAModelConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
                         q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=12, intermediate_size=80,
                         max_position=64, rms_norm_eps=hf_cfg.rms_norm_eps, index_topk=5,
                         index_n_heads=8, index_head_dim=16, index_cache_dtype=torch.float32)
    model = TinyDeepseek(cfg, AttentionConfig(backend=backend)).eval()
    load_hf_deepseek(model, hf)
    model.to(DEVICE)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (13, 17)]
    with torch.no_grad():
        want = [hf(s[None]).logits[0] for s in seqs]
        alloc = BlockAllocator(NUM_BLOCKS, model.block_size, shuffle=True, seed=1)
        caches = model.allocate_kv_caches(NUM_BLOCKS)
        for latent, _, _ in caches:
            latent.fill_(float("nan"))
        for start, stop in ((0, 6), (6, 12), (12, 13)):
            meta = build_batch(alloc, [0, 1], [start, start], [stop - start] * 2,
                               device=DEVICE)
            ids = torch.cat([s[start:stop] for s in seqs]).to(DEVICE)
            logits = model(ids, meta.positions, caches, meta).cpu()
            n = stop - start
            for r in range(2):
                torch.testing.assert_close(logits[r * n:(r + 1) * n], want[r][start:stop],
                                           atol=2e-4, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flashinfer_sparse_at_real_sizes_matches_triton_sparse():
    """FLASHINFER_MLA_SPARSE on the device (FlashInfer's own kernel, planned on the host)
    against TRITON_MLA_SPARSE on the same selection: 128 heads, 512 + 64 latent, top-k 2048,
    page 64, bf16; 8 decodes at 100-9000 tokens plus a 3-token speculative decode."""
    pytest.importorskip("flashinfer")
    from attn_ops.metadata import CommonAttentionMetadata

    torch.manual_seed(1)
    dev, dt, page = "cuda", torch.bfloat16, 64
    lens, new = [120, 3000, 9000, 2047, 2049, 700, 5000, 64, 4000], [1] * 8 + [3]
    blocks = sum(-(-n // page) for n in lens) + 8
    perm = torch.randperm(blocks, device=dev).to(torch.int32)
    width = max(-(-n // page) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
    at = 0
    for r, n in enumerate(lens):
        table[r, :-(-n // page)] = perm[at:at + -(-n // page)]
        at += -(-n // page)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    pos = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, new)]).to(dev)
    req = torch.repeat_interleave(torch.arange(len(lens), device=dev),
                                  torch.tensor(new, device=dev))
    slot = table[req, pos // page].long() * page + pos % page
    t = int(qsl[-1])
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq, seq_lens_cpu=seq.cpu(),
        block_table=table, slot_mapping=slot, num_actual_tokens=t, max_query_len=3,
        max_seq_len=max(lens), num_decodes=len(lens), num_decode_tokens=t, block_size=page,
        block_table_cpu=table.cpu(), num_blocks=blocks)
    # each token's selection in the indexer's layout: min(2048, position + 1) ascending slots
    rows = []
    for r, p in zip(req.tolist(), pos.tolist()):
        chosen = torch.randperm(p + 1)[:min(2048, p + 1)].sort().values
        row = torch.full((2048,), -1, dtype=torch.long)
        row[:chosen.numel()] = chosen
        rows.append(row)
    positions = torch.stack(rows).to(dev, torch.int32)
    slots = indexer_slots(positions, table, qsl, page)
    spec = AttentionSpec.mla(128, dtype=dt, block_size=page, index_topk=2048)
    w = (torch.randn(128 * 256, 512, device=dev) / 512 ** 0.5).to(dt)
    latent = torch.randn(blocks, page, 576, device=dev, dtype=dt)
    q = torch.randn(t, 128, 192, device=dev, dtype=dt)
    kv_c = torch.randn(t, 512, device=dev, dtype=dt)
    k_pe = torch.randn(t, 64, device=dev, dtype=dt)
    outs = {}
    for backend in ("FLASHINFER_MLA_SPARSE", "TRITON_MLA_SPARSE"):
        layer = MLAAttention(spec, AttentionConfig(backend=backend)).to(dev)
        layer.load_kv_b_proj(w)
        outs[backend] = layer(q, kv_c, k_pe, latent.clone(), common, topk_slots=slots).float()
    a, b = outs["FLASHINFER_MLA_SPARSE"], outs["TRITON_MLA_SPARSE"]
    assert ((a - b).norm() / b.norm()).item() < 1e-2


def _sparse_graph_backends():
    from attn_ops.capabilities import CUDAGraphSupport

    spec = AttentionSpec.mla(128, dtype=torch.bfloat16, block_size=64, index_topk=2048)
    return [b.value for b in sorted(MLA_BACKENDS, key=lambda b: b.value)
            if not get_backend_class(b.value).not_supported_reasons(spec, PLATFORM)
            and get_backend_class(b.value).cudagraph_support(spec, PLATFORM)
            >= CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _sparse_graph_backends() if PLATFORM.is_gpu else [])
def test_sparse_graph_replays_of_random_decode_batches_match_eager(backend):
    """Through the graph path's metadata (CUDAGraphBatch): capture once per size (1, 8, 32
    decodes; 128 heads, top-k 2048, page 64, bf16), then replay 100 random batches (sizes up
    and down, contexts 1-6000 tokens, dense and sparse, pages in random order, each token's
    selection random in the indexer's layout): each replay equals the eager layer on the same
    step and its padding rows stay zero."""
    import random

    from attn_ops import build_step_metadata
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.testing import capture_graph, random_decode_batch

    sizes, width, page, topk = (1, 8, 32), 94, 64, 2048
    rng, gen = random.Random(7), torch.Generator(device="cuda").manual_seed(7)
    spec = AttentionSpec.mla(128, dtype=torch.bfloat16, block_size=page, index_topk=topk)
    graphs = CUDAGraphBatch(sizes, width, page, "cuda")
    layer = MLAAttention(spec, AttentionConfig(backend=backend)).cuda()
    layer.load_kv_b_proj((torch.randn(128 * 256, 512, device="cuda") / 512 ** 0.5)
                         .to(spec.dtype))
    num_blocks = sizes[-1] * width + 1
    cache = layer.allocate_cache(num_blocks, "cuda")
    cache.copy_(torch.randn(cache.shape, generator=gen, device="cuda").to(cache.dtype))
    rows_max = sizes[-1]
    q = torch.randn(rows_max, 128, spec.head_dim, generator=gen, device="cuda").to(spec.dtype)
    kv_c = torch.randn(rows_max, 512, device="cuda").to(spec.dtype)
    k_pe = torch.randn(rows_max, 64, device="cuda").to(spec.dtype)
    slots = torch.full((rows_max, topk), -1, dtype=torch.int32, device="cuda")

    def batch(n):
        common = random_decode_batch(n, num_blocks, rng, page, 6000, device="cuda")
        rows = torch.full((n, topk), -1, dtype=torch.int32)
        for r, length in enumerate(common.seq_lens_cpu.tolist()):
            k = min(topk, length)
            rows[r, :k] = torch.randperm(length)[:k].sort().values.to(torch.int32)
        slots.fill_(-1)
        slots[:n] = indexer_slots(rows.cuda(), common.block_table, common.query_start_loc, page)
        return common

    captured, results = {}, {}
    for size in sizes:
        step = build_step_metadata(layer, batch(size), graphs)
        captured[size], results[size] = capture_graph(lambda: layer(
            q[:size], kv_c[:size], k_pe[:size], cache, step, topk_slots=slots[:size]))
    for i in range(100):
        n = rng.choice([1, 2, 5, 8, 13, 32, 31, 17])
        common = batch(n)
        build_step_metadata(layer, common, graphs)  # (fills the graphs' persistent tensors)
        size = graphs.size_for(n)
        q.normal_(generator=gen)
        kv_c.normal_(generator=gen)
        captured[size].replay()
        got = results[size]
        eager = layer(q[:n], kv_c[:n], k_pe[:n], cache, common, topk_slots=slots[:n])
        assert (got[n:size] == 0).all(), "padding rows must be zero on replay"
        torch.testing.assert_close(got[:n], eager, atol=1e-2, rtol=1e-2,
                                   msg=f"replay {i}: {n} requests in the graph of {size}")


# --- FlashMLA's fp8_ds_mla layout and FLASHMLA_SPARSE ------------------------------------------

DS_SPEC = AttentionSpec.mla(16, dtype=torch.bfloat16, block_size=PAGE, index_topk=100,
                            kv_cache_dtype="fp8_ds_mla")  # (DeepSeek's widths: 512 + 64)


def _ds_bytes(c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """FlashMLA's documented 656-byte row of each token, built here independently: 512 e4m3
    values c / s, then 4 little-endian fp32 scales s = amax / 448 of each 128, then 64 bf16
    rope values."""
    out = []
    for row, pe in zip(c.float(), k_pe):
        parts, scales = [], []
        for tile in row.view(4, 128):
            s = float(tile.abs().max()) / 448 or 1.0
            scales.append(s)
            parts.append((tile / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
        out.append(torch.cat([*parts, torch.tensor(scales, dtype=torch.float32)
                              .view(torch.uint8), pe.to(torch.bfloat16).view(torch.uint8)]))
    return torch.stack(out)


def _ds_values(rows: torch.Tensor) -> torch.Tensor:
    """The [.., 576] fp32 values of 656-byte rows, read by the documented layout."""
    raw = rows.view(torch.uint8)
    c = raw[..., :512].view(torch.float8_e4m3fn).float()
    s = raw[..., 512:528].contiguous().view(torch.float32)
    pe = raw[..., 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat([(c.unflatten(-1, (4, 128)) * s[..., None]).flatten(-2), pe], -1)


def test_ds_latent_write_stores_flashmlas_656_byte_rows_and_clears_entered_pages():
    """``mla_cache_update`` into an fp8_ds_mla cache (and the RoPE-fused write) stores each
    token's row byte for byte as FlashMLA documents it, skips -1 and out-of-range slots, and
    zeroes the unused rows of every page it enters (zero bytes read as zeros)."""
    from attn_ops.backends.mla.rope import mla_rope, mla_rope_cache_update

    g = torch.Generator().manual_seed(0)
    layer = MLAAttention(DS_SPEC, AttentionConfig(backend="REFERENCE_MLA_SPARSE"))
    cache = layer.allocate_cache(6, "cpu")
    assert cache.shape == (6, PAGE, 656) and cache.dtype == torch.float8_e4m3fn
    cache.view(torch.uint8).fill_(0x7F)  # (NaN bytes everywhere: stale rows)
    c = torch.randn(5, 512, generator=g).bfloat16() * torch.tensor([1e-3, 1, 30, 0, 2]
                                                                   ).bfloat16()[:, None]
    k_pe = torch.randn(5, 64, generator=g).bfloat16()
    slots = torch.tensor([8, -1, 0, 6 * PAGE, 5])  # (pages 2 and 0 entered, page 1 not)
    mla_cache_update(c, k_pe, cache, slots, None)
    flat = cache.view(-1, 656).view(torch.uint8)
    want = _ds_bytes(c, k_pe)
    assert torch.equal(flat[8], want[0]) and torch.equal(flat[0], want[2])
    assert torch.equal(flat[5], want[4])
    assert (flat[9:12] == 0).all() and (flat[1:4] == 0).all()  # (the entered pages' tails)
    assert (flat[[4, 6, 7]] == 0x7F).all() and (flat[16:20] == 0x7F).all()  # (untouched)
    got = _ds_values(flat[[8, 0, 5]])
    truth = torch.cat([c, k_pe], -1)[[0, 2, 4]].float()
    assert torch.allclose(got, truth, rtol=0.07, atol=1e-6)  # (e4m3: 3 mantissa bits)
    # the RoPE-fused write stores what mla_rope then the write store
    q = torch.randn(5, 16, 192, generator=g).bfloat16()
    cos_sin = torch.randn(5, 64, generator=g).bfloat16()
    other = torch.zeros_like(cache)
    mla_rope_cache_update(q, c, k_pe, cos_sin, other, slots, None)
    _, k_rot = mla_rope(q, k_pe, cos_sin)
    assert torch.equal(other.view(-1, 656).view(torch.uint8)[8], _ds_bytes(c, k_rot)[0])


@pytest.mark.parametrize("rank,rope,dtype", [(512, 64, torch.bfloat16), (256, 32, torch.float16),
                                             (384, 64, torch.float32)])
def test_ds_pack_in_one_launch_is_the_torch_pack_byte_for_byte(rank, rope, dtype):
    """The GPU's one-launch pack of fp8_ds_mla rows (here in Triton's interpreter, or compiled
    on a GPU) against the torch form, byte for byte: tiles of every magnitude, an all-zero
    tile (scale 1.0), values at the saturation bound and on rounding ties."""
    from attn_ops.backends.mla.ds_cache import FP8_MAX, TILE, ds_pack
    from attn_ops.backends.mla.ds_kernels import ds_pack_triton

    g = torch.Generator().manual_seed(rank)
    c = torch.randn(7, rank, generator=g) * torch.logspace(-4, 3, 7)[:, None]
    c[2, :TILE] = 0.0
    c[3, :9] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, 3.0, -0.0, 2.0 ** -9, 2.0 ** -10,
                             -(2.0 ** -11)])
    c, k_pe = c.to(dtype).to(DEVICE), torch.randn(7, rope, generator=g).to(DEVICE)
    rope_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    want = ds_pack(c, k_pe.to(rope_dtype), rope_dtype)
    got = ds_pack_triton(c, k_pe.to(rope_dtype), rope_dtype, TILE, FP8_MAX)
    assert got.shape == want.shape == (7, rank + rank // 32 + 2 * rope)
    assert torch.equal(got, want)


def test_a_per_tensor_fp8_cache_of_deepseek_widths_is_not_taken_for_a_ds_cache():
    """576 fp8 values a row (512 + 64, per-tensor scale) is also the width of an fp8_ds_mla row
    of rope 24: the sparse ops read the rope width from q, so this cache checks as it is."""
    from attn_ops.backends.mla.sparse import check_sparse_mla_inputs

    t, bf16 = 3, torch.bfloat16
    args = [torch.zeros(t, 16, 192, dtype=bf16), torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn),
            torch.zeros(16, 128, 512, dtype=bf16), torch.zeros(16, 512, 128, dtype=bf16),
            torch.zeros(t, 8, dtype=torch.int32), torch.zeros(t, 16, 128, dtype=bf16),
            torch.ones(1), 0.1, []]
    check_sparse_mla_inputs(*args)
    args[6] = None  # (a per-tensor fp8 cache still needs its scale)
    with pytest.raises(ValueError, match="needs a one-element float32 kv_scale"):
        check_sparse_mla_inputs(*args)


def test_fp8_ds_mla_is_an_mla_layout_of_16_bit_models_only():
    with pytest.raises(ValueError, match="fp8_ds_mla .* kv_lora_rank a multiple of 128"):
        AttentionSpec.mla(16, kv_lora_rank=96, dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="16-bit dtype"):
        AttentionSpec.mla(16, dtype=torch.float32, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="needs an MLA spec"):
        AttentionSpec(num_heads=8, head_dim=128, kv_cache_dtype="fp8_ds_mla")
    assert DS_SPEC.latent_row_width == 656


def standin_flashmla_sparse():
    """FlashMLA's sparse fp8 decode in torch with its contract: q [b, 1, 64 | 128 heads, 576],
    the fp8 cache [blocks, page, 1, 656] (rows read by the documented layout), indices [b, 1,
    a multiple of 64] int32 of global slots, -1 skipped and nothing else outside the cache,
    no block table or lengths, a schedule object computed by its first call."""
    import dataclasses as dc
    import types

    mod = types.ModuleType("flash_mla")
    mod.calls = []

    @dc.dataclass
    class FlashMLASchedMeta:
        shape: tuple | None = None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None, out=None):
        b, s_q, heads, d = q.shape
        assert heads in (64, 128) and d == 576 and s_q == 1 and head_dim_v == 512
        assert b <= FLASHMLA_MAX_ROWS  # (its tile scheduler's shared memory)
        assert block_table is None and cache_seqlens is None and is_fp8_kvcache and not causal
        assert k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[2:] == (1, 656)
        assert indices.dtype == torch.int32 and indices.shape[:2] == (b, 1)
        assert indices.shape[2] % 64 == 0
        capacity = k_cache.shape[0] * k_cache.shape[1]
        assert ((indices == -1) | ((indices >= 0) & (indices < capacity))).all()
        meta = tile_scheduler_metadata
        if meta.shape is None:
            meta.shape = (b, heads, indices.shape[2])
        assert meta.shape == (b, heads, indices.shape[2])  # (valid for its shape only)
        mod.calls.append(b)
        flat = _ds_values(k_cache.view(-1, 656)).double()
        o = torch.zeros(b, 1, heads, head_dim_v, dtype=q.dtype)
        for r in range(b):
            sel = indices[r, 0][indices[r, 0] >= 0].long()
            if not len(sel):
                continue
            kv = flat[sel]
            score = q[r, 0].double() @ kv.T * softmax_scale
            o[r, 0] = (torch.softmax(score, -1) @ kv[:, :512]).to(q.dtype)
        return o, torch.zeros(b, heads, 1)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None,
                             topk_length=None, out=None):
        s_q, heads, d = q.shape
        assert heads in (64, 128) and d == 576 and d_v == 512
        assert q.dtype == kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.shape[1:] == (1, d)
        assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1)
        assert indices.shape[2] % 128 == 0
        mod.prefill_calls.append(s_q)
        rows = kv[:, 0].double()
        o = torch.zeros(s_q, heads, d_v, dtype=q.dtype)
        for r in range(s_q):  # (entries outside [0, s_kv) skipped by the kernel itself)
            idx = indices[r, 0]
            sel = idx[(idx >= 0) & (idx < kv.shape[0])].long()
            if len(sel):
                score = q[r].double() @ rows[sel].T * sm_scale
                o[r] = (torch.softmax(score, -1) @ rows[sel, :d_v]).to(q.dtype)
        if out is not None:
            assert out.shape == o.shape and out.is_contiguous()
            out.copy_(o)
            o = out
        return o, torch.zeros(s_q, heads), torch.zeros(s_q, heads)

    mod.prefill_calls = []
    mod.FlashMLASchedMeta = FlashMLASchedMeta
    mod.get_mla_metadata = lambda *a, **k: (FlashMLASchedMeta(), None)
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return mod


@pytest.fixture
def flashmla_sparse_h200(monkeypatch):
    import dataclasses as dc
    import sys

    from attn_ops.platforms import Platform

    mod = standin_flashmla_sparse()
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    return dc.replace(Platform.parse("cuda:9.0"), assume_packages=True), mod


def _ds_step(spec, reqs, seed=0):
    """A step over the spec's cache (fp8_ds_mla or bf16) holding each request's context
    (written by the layer's write), the new tokens' latents, queries, weights and a selection
    with -1 holes and out-of-range entries anywhere (every fifth token selects nothing)."""
    g = torch.Generator().manual_seed(seed)
    h, nope, v = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim
    w = (torch.randn(h * (nope + v), 512, generator=g) / 512 ** 0.5).bfloat16()
    alloc = BlockAllocator(NUM_BLOCKS, PAGE, shuffle=True, seed=seed)
    cache = torch.zeros(NUM_BLOCKS, PAGE, spec.latent_row_width,
                        dtype=spec.kv_cache_dtype.storage_dtype(spec.dtype))
    with_ctx = [i for i, (c, _) in enumerate(reqs) if c]
    pre = build_batch(alloc, with_ctx, [0] * len(with_ctx), [reqs[i][0] for i in with_ctx],
                      decode_threshold=0)
    rows = torch.randn(pre.slot_mapping.shape[0], 576, generator=g).bfloat16()
    mla_cache_update(rows[:, :512], rows[:, 512:], cache, pre.slot_mapping, None)
    total = sum(n for _, n in reqs)
    meta = build_batch(alloc, list(range(len(reqs))), [c for c, _ in reqs], [n for _, n in reqs],
                       num_tokens_padded=total + 2, decode_threshold=4)
    positions = _selection(g, reqs, total, 2, spec.index_topk)
    slots = _slots(positions, meta)
    slots[0, 3] = NUM_BLOCKS * PAGE + 7  # (outside the cache: skipped, never read)
    slots[1, 0] = -5
    q = torch.randn(total + 2, h, 192, generator=g).bfloat16()
    new = torch.randn(total + 2, 576, generator=g).bfloat16()
    return w, cache, meta, slots, q, new


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_flashmla_sparse_runs_what_reference_mla_sparse_does_on_the_cache(
        flashmla_sparse_h200, heads, cache_dtype):
    """FLASHMLA_SPARSE against REFERENCE_MLA_SPARSE on the same cache: over fp8_ds_mla every
    token one row of FlashMLA's sparse fp8 decode (heads padded to 64 / 128, the selection
    padded to 64-slot blocks, out-of-range entries made -1); over bf16 every token through
    its sparse prefill kernel in one launch (the selection padded to 128-slot blocks)."""
    platform, mod = flashmla_sparse_h200
    spec = DS_SPEC.with_(num_heads=heads, kv_cache_dtype=cache_dtype)
    w, cache, meta, slots, q, new = _ds_step(spec, SCENARIOS["mixed"])
    outs = {}
    for backend in ("FLASHMLA_SPARSE", "REFERENCE_MLA_SPARSE"):
        layer = MLAAttention(spec, AttentionConfig(backend=backend), platform=platform)
        layer.load_kv_b_proj(w)
        outs[backend] = layer(q, new[:, :512], new[:, 512:], cache.clone(), meta,
                              topk_slots=slots).float()
    assert (mod.calls, mod.prefill_calls) == (([q.shape[0]], []) if cache_dtype == "fp8_ds_mla"
                                              else ([], [q.shape[0]]))
    ours, ref = outs["FLASHMLA_SPARSE"], outs["REFERENCE_MLA_SPARSE"]
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-2
    assert ours.isfinite().all()


def test_flashmla_sparse_runs_long_steps_in_calls_its_scheduler_takes(flashmla_sparse_h200,
                                                                       monkeypatch):
    """A step of more tokens than FlashMLA's tile scheduler takes rows (a long prefill over
    the fp8_ds_mla cache) runs in calls of at most Tuning.mla.flashmla_rows_a_call rows, each
    with its schedule, with the result of one call."""
    platform, mod = flashmla_sparse_h200
    w, cache, meta, slots, q, new = _ds_step(DS_SPEC, SCENARIOS["mixed"])

    def run():
        layer = MLAAttention(DS_SPEC, AttentionConfig(backend="FLASHMLA_SPARSE"),
                             platform=platform)
        layer.load_kv_b_proj(w)
        return layer(q, new[:, :512], new[:, 512:], cache.clone(), meta, topk_slots=slots)

    whole = run()
    monkeypatch.setenv("ATTN_OPS_TUNING", "mla.flashmla_rows_a_call=4")
    mod.calls.clear()
    assert torch.equal(run(), whole)
    assert mod.calls == [min(4, q.shape[0] - r) for r in range(0, q.shape[0], 4)]


def test_flashmla_sparse_op_passes_opcheck(flashmla_sparse_h200):
    platform, _ = flashmla_sparse_h200
    w, cache, meta, slots, q, new = _ds_step(DS_SPEC, SCENARIOS["decode_only"])
    layer = MLAAttention(DS_SPEC, AttentionConfig(backend="FLASHMLA_SPARSE"), platform=platform)
    layer.load_kv_b_proj(w)
    from test_ops import _test_utils  # (test_schema cannot compare fp8 tensors)

    torch.library.opcheck(layer.impl.op, (q, cache, layer.w_uk, layer.w_uv, slots,
                                          q.new_empty(q.shape[0], 16, 128), None,
                                          DS_SPEC.softmax_scale, []),
                          test_utils=_test_utils(cache.dtype))


def test_flashmla_sparse_is_selected_for_ds_caches_on_sm90_and_says_why_not_elsewhere(
        no_providers):
    import dataclasses as dc

    from attn_ops.platforms import Platform

    h200 = dc.replace(Platform.parse("cuda:9.0"), assume_packages=True)
    assert select_backend(DS_SPEC.with_(block_size=64), h200).backend == "FLASHMLA_SPARSE"
    auto = {c.name: c for c in candidates_for(DS_SPEC.with_(kv_cache_dtype="auto"), h200)}
    assert not auto["FLASHMLA_SPARSE"].reasons
    e4m3 = {c.name: c for c in candidates_for(DS_SPEC.with_(kv_cache_dtype="fp8_e4m3"), h200)}
    assert any("kv_cache_dtype=fp8_e4m3 not in" in str(r)
               for r in e4m3["FLASHMLA_SPARSE"].reasons)
    wide = {c.name: c for c in candidates_for(DS_SPEC.with_(num_heads=256), h200)}
    assert any("at most 128 query heads" in str(r) for r in wide["FLASHMLA_SPARSE"].reasons)
    bare = {c.name: c for c in candidates_for(DS_SPEC, Platform.parse("cuda:9.0"))}
    assert any(str(r).startswith("no provider of FlashMLA is usable here")
               for r in bare["FLASHMLA_SPARSE"].reasons)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("heads", [128, 16])
def test_flashmla_sparse_at_real_sizes_matches_the_reference_and_replays_in_graphs(
        heads, cache_dtype):
    """FLASHMLA_SPARSE on the GPU (DeepSeek dims, top-k 2048, page 64, an fp8_ds_mla or bf16
    cache written by the layer's write; decodes, a speculative decode and prefills;
    selections with -1 holes and out-of-range entries) against REFERENCE_MLA_SPARSE on the
    same cache; then captured in a CUDA graph and replayed over new queries and selections,
    each replay equal to the eager layer."""
    from attn_ops.testing import capture_graph

    spec = AttentionSpec.mla(heads, dtype=torch.bfloat16, block_size=64, index_topk=2048,
                             kv_cache_dtype=cache_dtype)
    if not PLATFORM.is_gpu or get_backend_class("FLASHMLA_SPARSE").not_supported_reasons(
            spec, PLATFORM):
        pytest.skip("FLASHMLA_SPARSE does not run here (its reasons are tested)")
    g = torch.Generator().manual_seed(heads)
    reqs, page, blocks = [(4000, 1), (300, 1), (1, 1), (2500, 3), (0, 700), (1200, 50)], 64, 320
    alloc = BlockAllocator(blocks, page, shuffle=True, seed=1)
    cache = torch.zeros(blocks, page, spec.latent_row_width, device="cuda",
                        dtype=spec.kv_cache_dtype.storage_dtype(spec.dtype))
    with_ctx = [i for i, (c, _) in enumerate(reqs) if c]
    pre = build_batch(alloc, with_ctx, [0] * len(with_ctx), [reqs[i][0] for i in with_ctx],
                      decode_threshold=0, device="cuda")
    rows = torch.randn(pre.slot_mapping.shape[0], 576, generator=g).bfloat16().cuda()
    mla_cache_update(rows[:, :512], rows[:, 512:], cache, pre.slot_mapping, None)
    total = sum(n for _, n in reqs)
    meta = build_batch(alloc, list(range(len(reqs))), [c for c, _ in reqs], [n for _, n in reqs],
                       device="cuda", decode_threshold=4)
    junk = torch.tensor([blocks * page, blocks * page + 7, 2 ** 30, -5], dtype=torch.int32)

    def selection():
        positions = _selection(g, reqs, total, 0, 2048)
        slots = _slots(positions, meta).cpu()
        holes = (slots < 0).nonzero()[::7]  # (some holes become entries to skip)
        slots[holes[:, 0], holes[:, 1]] = junk[torch.arange(len(holes)) % 4]
        return slots.cuda()

    w = (torch.randn(heads * 256, 512, generator=g) / 512 ** 0.5).bfloat16().cuda()
    layers = {}
    for backend in ("FLASHMLA_SPARSE", "REFERENCE_MLA_SPARSE"):
        layers[backend] = MLAAttention(spec, AttentionConfig(backend=backend)).cuda()
        layers[backend].load_kv_b_proj(w)
    q = torch.randn(total, heads, 192, generator=g).bfloat16().cuda()
    new = torch.randn(total, 576, generator=g).bfloat16().cuda()
    slots = selection()

    def run(backend):
        return layers[backend](q, new[:, :512], new[:, 512:], cache, meta, topk_slots=slots)

    ours, ref = run("FLASHMLA_SPARSE").float(), run("REFERENCE_MLA_SPARSE").float()
    assert ours.isfinite().all()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-2
    graph, result = capture_graph(lambda: run("FLASHMLA_SPARSE"))
    for _ in range(5):
        q.normal_(generator=None)
        slots.copy_(selection())
        graph.replay()
        torch.testing.assert_close(result, run("FLASHMLA_SPARSE"), atol=1e-2, rtol=1e-2)
