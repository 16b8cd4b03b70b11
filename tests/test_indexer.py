"""The sparse-MLA indexer's ops: the index-key write (bf16 / fp32 / fp8 with per-token and
per-128-channel scales), top-k against a dense fp64 computation written independently, the
tie rule, the dense case, slot conversion with permuted pages, NaN-poisoned unused slots,
opcheck and compile."""

from __future__ import annotations

import pytest
import torch

from attn_ops.backends.mla.indexer import (FP8, allocate_index_cache, indexer_k_write,
                                           indexer_slots, indexer_topk)

PAGE = 4


def _batch(g, lens, new, pages_per_req=6, num_blocks=40):
    """A paged batch: request r has ``lens[r]`` tokens, its last ``new[r]`` new this step;
    its pages a random permutation of the pool."""
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[:len(lens) * pages_per_req].view(len(lens), pages_per_req).to(torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    return table, torch.tensor(lens, dtype=torch.int32), qsl


def _fill(g, table, lens, dim, dtype, scale_block=None, poison=True, num_blocks=40):
    keys, scales = allocate_index_cache(num_blocks, PAGE, dim, dtype, scale_block)
    if poison:  # every slot no request owns holds NaN
        if dtype == FP8:
            keys.view(torch.uint8).fill_(0x7F)  # (e4m3fn's NaN)
        else:
            keys.fill_(float("nan"))
    per_req = []
    for r, n in enumerate(lens.tolist()):
        k = torch.randn(n, dim, generator=g)
        pos = torch.arange(n)
        slots = table[r, pos // PAGE].long() * PAGE + pos % PAGE
        indexer_k_write(k, keys, scales, slots)
        per_req.append(k)
    return keys, scales, per_req


def _dense_topk(q, w, ks, lens, new, topk):
    """Per query token, by plain Python sorting in fp64: (score desc, position asc)."""
    out, row = [], 0
    for k, n_all, n_new in zip(ks, lens, new):
        for i in range(n_new):
            p = n_all - n_new + i
            scored = []
            for j in range(p + 1):
                s = sum(float(w[row, h]) * max(float(q[row, h].double() @ k[j].double()), 0.0)
                        for h in range(q.shape[1]))
                scored.append((-s, j))
            out.append(sorted(j for _, j in sorted(scored)[:topk]))
            row += 1
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_a_dense_fp64_selection(dtype):
    g = torch.Generator().manual_seed(0)
    lens, new, h, d, topk = [13, 9, 20, 3], [1, 9, 5, 2], 3, 8, 6
    table, seq_lens, qsl = _batch(g, lens, new)
    keys, scales, ks = _fill(g, table, seq_lens, d, dtype)
    t = sum(new) + 2  # two padding rows
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    got = indexer_topk(q.to(dtype), w, keys, scales, table, seq_lens, qsl, topk)
    want = _dense_topk(q.to(dtype).double(), w, [k.to(dtype) for k in ks], lens, new, topk)
    for row, sel in enumerate(want):
        assert got[row, :len(sel)].tolist() == sel, row
        assert (got[row, len(sel):] == -1).all()
    assert (got[sum(new):] == -1).all()


def test_equal_scores_keep_the_lower_position_and_short_requests_are_dense():
    keys, scales = allocate_index_cache(4, PAGE, 2, torch.float32)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    k = torch.tensor([[1.0, 0.0]] * 10)  # every key scores the same
    pos = torch.arange(10)
    indexer_k_write(k, keys, scales, table[0, pos // PAGE].long() * PAGE + pos % PAGE)
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    got = indexer_topk(q, torch.ones(2, 1), keys, scales, table, torch.tensor([10]),
                       torch.tensor([0, 2]), 4)
    assert got.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    dense = indexer_topk(q, torch.ones(2, 1), keys, scales, table, torch.tensor([10]),
                         torch.tensor([0, 2]), 16)
    assert dense[0].tolist() == list(range(9)) + [-1] * 7  # (position 8 sees 9 keys)
    assert dense[1].tolist() == list(range(10)) + [-1] * 6


@pytest.mark.parametrize("scale_block", [None, 128])
def test_fp8_cache_keeps_keys_within_its_precision_and_selects_nearly_the_same(scale_block):
    g = torch.Generator().manual_seed(1)
    lens, new, h, d, topk = [300, 200], [4, 3], 4, 256, 32
    table, seq_lens, qsl = _batch(g, lens, new, pages_per_req=80, num_blocks=160)
    exact, _, ks = _fill(torch.Generator().manual_seed(2), table, seq_lens, d, torch.float32,
                         poison=False, num_blocks=160)
    keys, scales = allocate_index_cache(160, PAGE, d, FP8, scale_block)
    for r, k in enumerate(ks):
        pos = torch.arange(k.shape[0])
        indexer_k_write(k, keys, scales, table[r, pos // PAGE].long() * PAGE + pos % PAGE)
    groups = scales.view(-1, scales.shape[2])
    deq = (keys.view(-1, d).float().view(-1, groups.shape[1], d // groups.shape[1])
           * groups[:, :, None]).view(-1, d)
    used = exact.view(-1, d).abs().sum(1) > 0
    err = (deq[used] - exact.view(-1, d)[used]).abs().max() / exact.abs().max()
    assert err < 0.07  # e4m3 keeps 3 mantissa bits
    q, w = torch.randn(sum(new), h, d, generator=g), torch.rand(sum(new), h, generator=g)
    a = indexer_topk(q, w, keys, scales, table, seq_lens, qsl, topk)
    b = indexer_topk(q, w, exact, None, table, seq_lens, qsl, topk)
    overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / a.numel()
    assert overlap >= 0.9


def test_slots_follow_each_rows_request_pages():
    table = torch.tensor([[5, 2, 7], [1, 4, 0]], dtype=torch.int32)
    positions = torch.tensor([[0, 5, -1], [9, 3, 4], [1, -1, -1], [0, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3])  # rows 0-1: request 0, row 2: request 1, row 3: padding
    got = indexer_slots(positions, table, qsl, PAGE)
    assert got.tolist() == [[20, 9, -1], [29, 23, 8], [5, -1, -1], [-1, -1, -1]]


def test_bad_inputs_name_the_value_and_the_fix():
    keys, scales = allocate_index_cache(2, PAGE, 8, FP8)
    with pytest.raises(ValueError, match=r"float32 scales \[num_blocks, page, groups\]"):
        indexer_k_write(torch.randn(1, 8), keys, None, torch.tensor([0]))
    with pytest.raises(ValueError, match="allocate_index_cache"):
        indexer_k_write(torch.randn(1, 6), keys, scales, torch.tensor([0]))
    with pytest.raises(ValueError, match="topk=0 must be >= 1"):
        indexer_topk(torch.randn(1, 2, 8), torch.randn(1, 2), keys, scales,
                     torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]),
                     torch.tensor([0, 1]), 0)
    with pytest.raises(ValueError, match="scale_block=48 must divide"):
        allocate_index_cache(2, PAGE, 128, FP8, 48)


def test_ops_pass_opcheck_and_compile_without_graph_breaks():
    g = torch.Generator().manual_seed(3)
    table, seq_lens, qsl = _batch(g, [7, 5], [2, 5])
    keys, scales, _ = _fill(g, table, seq_lens, 16, FP8, poison=False)
    q, w = torch.randn(7, 2, 16, generator=g), torch.randn(7, 2, generator=g)
    k = torch.randn(7, 16, generator=g)
    slot_mapping = torch.arange(7) + 100
    bf16_keys, _, _ = _fill(g, table, seq_lens, 16, torch.bfloat16, poison=False)
    # (opcheck with the fp8 cache would need fp8 arithmetic in its argument comparisons;
    # the compiled run below traces the fp8 case through the fakes)
    torch.library.opcheck(indexer_k_write, (k, bf16_keys.clone(), None, slot_mapping))
    torch.library.opcheck(indexer_topk, (q, w, bf16_keys, None, table, seq_lens, qsl, 4))
    pos = indexer_topk(q, w, keys, scales, table, seq_lens, qsl, 4)
    torch.library.opcheck(indexer_slots, (pos, table, qsl, PAGE))

    def select(q, w):
        return indexer_slots(indexer_topk(q, w, keys, scales, table, seq_lens, qsl, 4), table,
                             qsl, PAGE)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(select, fullgraph=True)(q, w), select(q, w))


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_hf_deepseek_v32_indexer_selects_the_same_positions(cache_dtype):
    """HF's ``DeepseekV32Indexer`` (small random config, fp32) over two requests' prompts in
    one prefill each, against ``MLAIndexer`` with the same weights running the batch in two
    steps (the second resumes each request mid-prompt from the paged index cache): identical
    top-k sets with an fp32 index cache, >= 99% overlap with fp8 (per-token scales)."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Indexer, DeepseekV32RotaryEmbedding)

    from attn_ops.layers.mla_indexer import MLAIndexer

    torch.manual_seed(4)
    cfg = DeepseekV32Config(hidden_size=64, q_lora_rank=32, index_n_heads=4, index_head_dim=32,
                            qk_rope_head_dim=16, qk_nope_head_dim=16, index_topk=8,
                            num_attention_heads=4, kv_lora_rank=16, v_head_dim=16)
    hf = DeepseekV32Indexer(cfg, 0).eval()
    ours = MLAIndexer(64, 32, num_heads=4, head_dim=32, rope_dim=16, topk=8)
    ours.load_state_dict(hf.state_dict())
    rope = DeepseekV32RotaryEmbedding(cfg)
    lens, first = [23, 14], [15, 6]  # prompt lengths; tokens in the first step
    xs = [torch.randn(n, 64) for n in lens]
    qr = [torch.randn(n, 32) for n in lens]
    want = []
    for x, q in zip(xs, qr):
        n = x.shape[0]
        cos, sin = rope(x[None], torch.arange(n)[None])
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        with torch.no_grad():
            top = hf(x[None], q[None], (cos, sin), mask, torch.arange(n)[None])[0]
        want.append([sorted(p for p in row.tolist() if p <= i) for i, row in enumerate(top)])

    keys, scales = ours.allocate_cache(16, PAGE, cache_dtype)
    table = torch.tensor([[3, 9, 0, 12, 5, 7], [8, 1, 14, 2, 11, 6]], dtype=torch.int32)
    got = [[], []]
    for lo, hi in ((lambda r: 0, lambda r: first[r]), (lambda r: first[r], lambda r: lens[r])):
        rows = [torch.arange(lo(r), hi(r)) for r in range(2)]
        x = torch.cat([xs[r][p] for r, p in enumerate(rows)])
        q = torch.cat([qr[r][p] for r, p in enumerate(rows)])
        pos = torch.cat(rows)
        cos, sin = rope(x[None], pos[None])
        slots = torch.cat([table[r, p // PAGE].long() * PAGE + p % PAGE
                           for r, p in enumerate(rows)])
        qsl = torch.tensor([0, len(rows[0]), len(rows[0]) + len(rows[1])])
        seq_lens = torch.tensor([hi(0), hi(1)])
        with torch.no_grad():
            positions, cache_slots = ours(x, q, cos[0], sin[0], keys, scales, slots, table,
                                          seq_lens, qsl)
        for r in range(2):
            for row, sl in zip(positions[qsl[r]:qsl[r + 1]], cache_slots[qsl[r]:qsl[r + 1]]):
                sel = [p for p in row.tolist() if p >= 0]
                assert sl[:len(sel)].tolist() == [int(table[r, p // PAGE]) * PAGE + p % PAGE
                                                  for p in sel]
                got[r].append(sel)
    if cache_dtype == torch.float32:
        assert got == want
    else:
        inter = sum(len(set(a) & set(b)) for r in range(2) for a, b in zip(got[r], want[r]))
        assert inter / sum(len(b) for r in range(2) for b in want[r]) >= 0.99


def _fp8_query(q):
    """``q`` as ``mla.index_fp8_query`` scores it: each head in e4m3 at amax / 448, back in
    fp32."""
    scale = q.float().abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448.0
    return (q.float() / scale).to(FP8).float() * scale


_ONE = (dict(block_n=32), True)
_SPLIT = (dict(block_n=16, chunk=32, select_span=32, select_block=16), True)
_UNFUSED = (dict(block_n=16, chunk=32), False)


_CACHES = [("fp32", *_ONE), ("fp8_token", *_ONE), ("fp8_token_half", *_ONE),
           ("fp8_block", *_ONE), ("fp32", *_SPLIT), ("fp8_block", *_SPLIT),
           ("fp8_token", *_UNFUSED), ("fp8_token_fp8_query", *_SPLIT)]
_CACHE_IDS = ["fp32-one-select", "fp8_token-one-select", "fp8_token_half-one-select",
              "fp8_block-one-select", "fp32-split-select", "fp8_block-split-select",
              "fp8_token-select-histograms-all", "fp8_token-fp8-query-split-select"]
# (the product's orientation and the select's counting are independent of the key format:
# every format with the heads as rows and block histograms, three with the other pair)
_TOPK_CASES = [pytest.param(*c, False, 4, 0, 1, id=f"{i}-heads-rows-histograms")
               for c, i in zip(_CACHES, _CACHE_IDS)] + \
    [pytest.param(*c, True, 0, 0, 1, id=f"{i}-keys-rows-atomics")
     for c, i in zip(_CACHES, _CACHE_IDS) if i in ("fp32-one-select", "fp8_block-split-select",
                                                  "fp8_token-fp8-query-split-select")] + \
    [pytest.param(*c, True, 1, 8, 1, id=f"{i}-candidates")
     for c, i in zip(_CACHES, _CACHE_IDS) if i in ("fp32-split-select",
                                                  "fp8_token-select-histograms-all")] + \
    [pytest.param(*_CACHES[1], True, 1, 0, 3, id=f"{_CACHE_IDS[1]}-three-row-groups")]


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("cache,launch,fused,keys_as_rows,atomic_from,candidates,groups",
                         _TOPK_CASES)
def test_device_topk_selects_what_the_reference_does(cache, launch, fused, keys_as_rows,
                                                     atomic_from, candidates, groups,
                                                     poisoned_buffers):
    """The GPU path (Triton scores, then a radix select; the interpreter here) against the
    torch reference: mixed decode / prefill rows, a request at exactly top-k visible keys,
    padding rows, permuted pages with NaN in every unowned slot, ties (repeated keys: the
    lower position), fp8 with per-token and per-128-channel scales (an fp16 query over
    per-token fp8 keys: the product in fp16, the scale after the ReLU; the query quantized to
    fp8 per head, ``index_fp8_query``, against the reference over the query it quantizes to),
    the position axis in one program or several, the select's spans of positions in one
    program or several, its first digit histogram added by the scoring or by its own
    launch, the product with the heads or the positions as its rows, the select's passes
    counted by block histograms or by each key's atomic add, or finished over 8 candidates a
    row (``index_select_candidates``), the rows in one group or three (each group's select
    on a side stream on a GPU: ``index_overlap_groups``); every buffer poisoned (the output's
    -1 tail written by the select)."""
    from attn_ops.backends.mla.indexer import topk_reference
    from attn_ops.backends.mla.indexer_kernels import indexer_topk_device
    from attn_ops.tuning import Tuning

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    lens, new, h, topk = [70, 9, 130, 12], [1, 9, 6, 3], 5, 12
    d = 256 if cache == "fp8_block" else 32
    dtype = torch.float32 if cache == "fp32" else FP8
    table, seq_lens, qsl = _batch(g, lens, new, pages_per_req=36, num_blocks=160)
    keys, scales, ks = _fill(g, table, seq_lens, d, dtype,
                             scale_block=128 if cache == "fp8_block" else None,
                             num_blocks=160)
    pos = torch.arange(5)  # request 2: positions 100-104 repeat position 0's key
    dup = table[2, (100 + pos) // PAGE].long() * PAGE + (100 + pos) % PAGE
    indexer_k_write(ks[2][:1].expand(5, -1), keys, scales, dup)
    t = sum(new) + 3
    q = torch.randn(t, h, d, generator=g)
    if cache == "fp8_token_half":
        q = q.half()
    w = torch.randn(t, h, generator=g)
    args = [x.to(dev) if x is not None else None
            for x in (q, w, keys, scales, table, seq_lens, qsl)]
    fp8_query = cache == "fp8_token_fp8_query"
    got = indexer_topk_device(*args, topk, **launch, tuning=Tuning().with_(
        mla={"index_fused_histogram": fused, "index_fp8_query": fp8_query,
             "index_keys_as_rows": keys_as_rows, "index_atomic_from_pass": atomic_from,
             "index_select_candidates": candidates, "index_overlap_groups": groups}))
    if fp8_query:  # the reference over the query as the scoring quantizes it
        args[0] = _fp8_query(q).to(dev)
    want = topk_reference(*args, topk)
    assert torch.equal(got.cpu(), want.cpu())
    assert (got[sum(new):] == -1).all()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("with_lens", [False, True])
@pytest.mark.parametrize("num_reqs,topk,index", [(1, 16, torch.int32), (4, 48, torch.int64),
                                                 (21, 2048, torch.int32)])
def test_slots_in_one_launch_equal_their_torch_definition(num_reqs, topk, index, with_lens):
    """``indexer_slots``' one-launch device path against its torch body: -1 positions kept,
    requests of 0 to 5 rows (empty ones first and last), a permuted block table with more rows
    than requests, padding rows past the last request (all -1), int64 positions, top-k over
    more than one program's block; positions past the table's columns (and, with
    ``seq_lens``, past the request's length) are -1, never a clamped page."""
    from attn_ops.backends.mla.indexer import slots_reference
    from attn_ops.backends.mla.indexer_kernels import indexer_slots_device

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(topk)
    page, width = 16, 9
    new = torch.randint(0, 6, (num_reqs,), generator=gen)
    new[0] = 0 if num_reqs > 2 else new[0]
    new[-1] = 0 if num_reqs > 2 else new[-1]
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(index)
    t = int(qsl[-1]) + 3
    table = torch.randperm((num_reqs + 2) * width, generator=gen).view(num_reqs + 2, width)
    pos = torch.randint(-1, (width + 2) * page, (t, topk), generator=gen)
    pos[:, -3:] = -1
    lens = torch.randint(0, width * page + 1, (num_reqs,), generator=gen)
    args = (pos.to(index).to(dev), table.to(torch.int32).to(dev), qsl.to(dev), page,
            lens.to(index).to(dev) if with_lens else None)
    got = indexer_slots_device(*args)
    want = slots_reference(*args)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu())
    assert (got[int(qsl[-1]):] == -1).all()
    assert (got[pos.to(dev) >= width * page] == -1).all()
    if with_lens:  # (each row against its own request's length)
        rows = torch.arange(int(qsl[-1]))
        req = torch.searchsorted(qsl[1:].cpu().long(), rows, right=True)
        assert (got[:int(qsl[-1])].cpu()[pos[:int(qsl[-1])] >= lens[req][:, None]] == -1).all()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("num_reqs,index", [(1, torch.int32), (3, torch.int64),
                                            (37, torch.int32)])
def test_visible_rows_in_one_launch_equal_their_torch_definition(num_reqs, index):
    """Each row's request and visible positions from the one-launch binary search against
    the torch definition: requests of 0 to 40 new tokens (empty ones among them, first and
    last too) over longer contexts, padding rows past the last request, more rows than one
    program's block."""
    from attn_ops.backends.mla.indexer_kernels import visible_rows, visible_rows_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(num_reqs)
    new = torch.randint(0, 41, (num_reqs,), generator=gen)
    new[::5] = 0
    new[-1] = 0 if num_reqs > 2 else new[-1]
    seq = new + torch.randint(0, 300, (num_reqs,), generator=gen)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to(index).to(dev)
    t = int(qsl[-1]) + 5
    # (200: some requests reach past their block table; ratios 4 and 128: DeepSeek-V4's
    # compressed entries, complete at (position + 1) // ratio)
    for limit, ratio in ((2 ** 20, 1), (200, 1), (60, 4), (2 ** 20, 128)):
        got = visible_rows_triton(t, seq.to(index).to(dev), qsl, limit, ratio)
        want = visible_rows(t, seq.to(index).to(dev), qsl, limit, ratio)
        for g, w in zip(got, want):
            assert g.dtype == torch.int32 and torch.equal(g.cpu(), w.cpu())
        assert int(want[1].max()) <= limit
        if ratio > 1:  # (the definition: a real row's position + 1, floored by the ratio)
            seen = visible_rows(t, seq.to(index).to(dev), qsl, 2 ** 20)[1]
            assert torch.equal(want[1].cpu(), (seen.cpu() // ratio).clamp(max=limit))


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("span", [256, 64, 16])
@pytest.mark.parametrize("candidates,values", [(0, "five"), (0, "normal"), (64, "five"),
                                               (64, "normal"), (2, "five"), (2, "normal")])
def test_device_select_breaks_ties_by_position(span, candidates, values):
    """The radix select alone on scores drawn from five values (-0.0 and +0.0 among them: one
    value), so the top-k threshold falls inside a run of equal scores in every row, or from a
    normal distribution: positions above it and the lowest-positioned equal ones, ascending,
    as a stable sort gives; rows seeing fewer than top-k positions take them all, padding
    rows none. By six launches, or by three over candidates (``index_select_candidates``:
    64 hold a row's run of equal scores; 2 overflow, and the finish reads its row again)."""
    from attn_ops.backends.mla.indexer_kernels import _select
    from attn_ops.tuning import default_tuning

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    rows, width, topk = 6, 200, 24
    if values == "five":
        scores = torch.tensor([-1.5, -0.0, 0.0, 0.75, 2.0])[
            torch.randint(0, 5, (rows, width), generator=g)]
    else:
        scores = torch.randn(rows, width, generator=g)
    vis = torch.tensor([200, 150, 25, 24, 7, 0], dtype=torch.int32)
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=dev)  # (the select fills -1)
    tuning = default_tuning().with_(mla={"index_select_candidates": candidates}).mla
    _select(scores.to(dev), None, vis.to(dev), out, 0, topk, 1, tuning, span, 16)
    for r in range(rows):
        n = int(vis[r])
        order = torch.sort(-scores[r, :n], stable=True).indices[:topk]
        want = torch.full((topk,), -1, dtype=torch.int32)
        want[:order.numel()] = order.sort().values.to(torch.int32)
        assert torch.equal(out[r].cpu(), want), r


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("cap", [64, 8])
def test_select_finish_takes_candidates_in_any_order(cap):
    """The candidates' finish alone (``topk_finish_kernel``), handed what the compact launch
    leaves on a GPU -- the positions above the decided 16 bits and the candidates sharing
    them, each in a shuffled order (atomic slots) -- over scores of five values, so equal keys
    straddle the top-k-th: the row sorted, the lowest-positioned equal keys taken; 8
    candidates overflow, and the row's scores are read again instead."""
    import numpy as np

    from attn_ops.backends.mla.indexer_kernels import HIST_ROW, topk_finish_kernel
    from attn_ops.routing import pow2

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    width, topk = 120, 40  # (about 24 of each value: the 40th among the second highest)
    scores = torch.tensor([-1.5, 0.5, 0.75, 2.0, 3.0])[torch.randint(0, 5, (width,),
                                                                       generator=g)]
    bits = scores.numpy().view(np.int32).astype(np.int64) & 0xFFFFFFFF
    keys = np.where(bits >> 31, bits ^ 0xFFFFFFFF, bits | 0x80000000)  # (the order key)
    order = torch.sort(-scores, stable=True).indices[:topk]
    top = int(keys[int(order[-1])]) >> 16
    above = np.flatnonzero((keys >> 16) > top)
    shared = np.flatnonzero((keys >> 16) == top)
    rng = np.random.default_rng(0)
    rng.shuffle(above)
    rng.shuffle(shared)
    out = torch.full((1, topk), -7, dtype=torch.int32)
    out[0, :above.size] = torch.from_numpy(above.astype(np.int32))
    cand = torch.full((1, cap), -7, dtype=torch.int32)
    cand[0, :min(cap, shared.size)] = torch.from_numpy(shared[:cap].astype(np.int32))
    hist = torch.zeros(1, HIST_ROW, dtype=torch.int32)
    state = 4 * 256 + 2  # (the state after the second pass)
    hist[0, state] = int(np.int64(top << 16).astype(np.uint32).view(np.int32))
    hist[0, state + 1] = topk - above.size
    counts = torch.tensor([[above.size, shared.size]], dtype=torch.int32)
    vis = torch.tensor([width], dtype=torch.int32)
    args = [x.to(dev) for x in (scores[None], vis, hist, counts, out, cand)]
    topk_finish_kernel[(1,)](*args, 0, topk, cap, width, topk, CAP_P=pow2(cap, 1),
                             TOPK_P=pow2(topk, 1), BLOCK=64, num_warps=4)
    assert above.size > 0 and 8 < shared.size <= 64 and topk - above.size < shared.size
    assert torch.equal(args[4][0].cpu(), order.sort().values.to(torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("cache", ["bf16", pytest.param("fp8_token", marks=pytest.mark.gpu),
                                   pytest.param("fp8_block", marks=pytest.mark.gpu)])
def test_device_key_write_stores_what_the_reference_does(cache):
    """The GPU write (a Triton launch; bf16 in the interpreter too) against the torch one: the
    same bytes and scales, padding rows (-1) skipped, other slots untouched. fp8 on the GPU
    only: the interpreter's fp8 conversion rounds values just under a power of two down a
    whole binade (127.5 -> 64)."""
    if cache != "bf16" and not torch.cuda.is_available():
        pytest.skip("fp8 conversion: GPU only (the interpreter's rounding is wrong)")
    from attn_ops.backends.mla.indexer import FP8_MAX, k_write_reference
    from attn_ops.backends.mla.indexer_kernels import indexer_k_write_device

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    d = 256 if cache == "fp8_block" else 48
    dtype = torch.bfloat16 if cache == "bf16" else FP8
    k = (torch.randn(9, d, generator=g) * 3).to(torch.bfloat16).to(dev)
    slots = torch.tensor([5, -1, 0, 17, 33, -1, 2, 40, 9], device=dev)
    want = allocate_index_cache(12, PAGE, d, dtype, 128 if cache == "fp8_block" else None,
                                device=dev)
    got = tuple(x.clone() if x is not None else None for x in want)
    k_write_reference(k, *want, slots)
    indexer_k_write_device(k, *got, slots, FP8_MAX)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    if dtype == FP8:
        assert torch.equal(got[1], want[1])


def test_indexer_launch_fills_the_sms_for_few_rows_and_keeps_long_programs_for_many():
    from attn_ops.routing import indexer_score_chunk, indexer_select_span
    from attn_ops.tuning import Tuning

    t = Tuning().with_(mla={"index_chunk": 2048}).mla
    # scoring: 1 decode row over 128k positions -> 256-position programs (512 of them);
    # 128 rows -> the whole chunk of 2048 (8k programs); a short context never below 256
    assert indexer_score_chunk(1, 131072, 64, 132, t) == 256
    assert indexer_score_chunk(8, 32768, 64, 132, t) == 512  # (8 x 64 >= 264)
    assert indexer_score_chunk(128, 131072, 64, 132, t) == 2048
    assert indexer_score_chunk(1, 300, 64, 132, t) == 256
    assert indexer_score_chunk(1, 4096, 512, 132, t) == 512  # (never below block_n)
    # the select: spans of 1024 until the programs exceed 8 x SMs
    assert indexer_select_span(1, 131072, 1024, 132, t) == 1024  # (128 programs)
    assert indexer_select_span(128, 32768, 1024, 132, t) == 4096  # (1024 programs)
    assert indexer_select_span(2048, 16384, 1024, 132, t) == 16384  # (a row a program)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache", ["bf16", "fp8_token", "fp8_token_fp8_query"])
def test_device_topk_at_real_sizes_selects_the_best_scores(cache):
    """DeepSeek-V3.2's indexer sizes: 64 heads x 128, top-k 2048, page 64, bf16 queries; a
    step of 6 decodes at 2048 (dense) to 40k positions and a 48-token prefill at 20k, each
    under the tuning's launch (few rows: positions over many programs, a two-stage select).
    The rows' selections against fp32 scores of the same cache: every row takes top-k
    positions (all it sees below that), and any position where it differs from the exact
    top-k scores within 1e-5 of the row's top-k-th score (products in bf16 with fp32 sums:
    only near-ties may swap); with ``index_fp8_query`` the exact scores are those of the query
    as it is quantized (per head, e4m3 at amax / 448), and the margin is 2^-10 of the
    position's sum of absolute terms: on sm90 Triton accumulates fp8 products in the tensor
    cores' own accumulator (about 14 mantissa bits), never promoted to fp32."""
    from attn_ops.backends.mla.indexer_kernels import indexer_topk_device
    from attn_ops.tuning import default_tuning

    torch.manual_seed(1)
    dev, page, h, d, topk = "cuda", 64, 64, 128, 2048
    lens = [2048, 2049, 9000, 17000, 33000, 40960, 20000]
    new = [1, 1, 1, 1, 1, 1, 48]
    blocks = sum(-(-n // page) for n in lens) + 8
    dtype = FP8 if cache.startswith("fp8_token") else torch.bfloat16
    keys, scales = allocate_index_cache(blocks, page, d, dtype, device=dev)
    keys.copy_(torch.randn(keys.shape, device=dev).to(dtype))
    if scales is not None:
        scales.copy_(torch.rand(scales.shape, device=dev) + 0.05)
    width = max(-(-n // page) for n in lens)
    perm = torch.randperm(blocks, device=dev)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
    at = 0
    for r, n in enumerate(lens):
        table[r, :-(-n // page)] = perm[at:at + -(-n // page)].to(torch.int32)
        at += -(-n // page)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32, device=dev)
    t = sum(new)
    q = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(t, h, device=dev) / h
    fp8_query = cache == "fp8_token_fp8_query"
    got = indexer_topk_device(q, w, keys, scales, table, seq_lens, qsl, topk,
                              tuning=default_tuning().with_(mla={"index_fp8_query": fp8_query}))
    if fp8_query:
        q = _fp8_query(q)
    row = 0
    for r, (n, m) in enumerate(zip(lens, new)):
        pos = torch.arange(n, device=dev)
        slots = table[r, pos // page].long() * page + pos % page
        k = keys.view(-1, d)[slots].float()
        if scales is not None:
            k = k * scales.view(-1, 1)[slots]
        score = torch.einsum("th,thj->tj", w[row:row + m],
                             torch.relu(torch.einsum("thd,jd->thj", q[row:row + m].float(), k)))
        terms = torch.einsum("th,thj->tj", w[row:row + m].abs(),
                             torch.einsum("thd,jd->thj", q[row:row + m].float().abs(), k.abs()))
        for i in range(m):
            vis = n - m + i + 1
            sel = got[row + i]
            if vis <= topk:
                assert torch.equal(sel[:vis].cpu(), torch.arange(vis, dtype=torch.int32))
                assert (sel[vis:] == -1).all()
                continue
            assert (sel >= 0).all() and (sel < vis).all() and (sel.diff() > 0).all(), (r, i)
            s = score[i, :vis]
            kth = s.topk(topk).values[-1]
            best = torch.zeros(vis, dtype=torch.bool, device=dev)
            best[s.topk(topk).indices] = True
            mine = torch.zeros(vis, dtype=torch.bool, device=dev)
            mine[sel.long()] = True
            differ = best ^ mine
            tol = 1e-5 * max(1.0, float(kth.abs()))
            if fp8_query:
                tol = tol + terms[i, :vis][differ] * 2.0 ** -10
            assert ((s[differ] - kth).abs() <= tol).all(), (r, i, int(differ.sum()))
        row += m


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,ctx", [(4, 3000), (4, 70000), (300, 20000)])
def test_fp8_index_keys_compile_and_run_at_every_page_size_and_topk(rows, ctx):
    """Every page size a block table may have (16-256) x the top-k of released configs
    (512-2048) x bf16 and fp32 queries over fp8 keys with per-token scales, decodes and a
    prefill chunk: each launch compiles within the device's shared memory and selects only
    visible positions, ascending."""
    from attn_ops.backends.mla.indexer_kernels import indexer_topk_device

    dev, h, d = "cuda", 64, 128
    for page in (16, 32, 64, 128, 256):
        width = -(-ctx // page)
        keys, scales = allocate_index_cache(width + 2, page, d, FP8, device=dev)
        keys.copy_(torch.randn(keys.shape, device=dev).to(FP8))
        scales.copy_(torch.rand(scales.shape, device=dev) + 0.05)
        table = torch.randperm(width + 2, device=dev)[:width].to(torch.int32)[None]
        seq = torch.tensor([ctx], dtype=torch.int32, device=dev)
        qsl = torch.tensor([0, rows], dtype=torch.int32, device=dev)
        for topk in (512, 1024, 2048):
            for qdtype in (torch.bfloat16, torch.float32):
                q = torch.randn(rows, h, d, device=dev, dtype=qdtype)
                w = torch.randn(rows, h, device=dev) / h
                got = indexer_topk_device(q, w, keys, scales, table, seq, qsl, topk)
                vis = ctx - rows + 1 + torch.arange(rows, device=dev)
                assert ((got >= 0) & (got < vis[:, None])).all(), (page, topk, qdtype)
                assert (got.diff(dim=1) > 0).all(), (page, topk, qdtype)
