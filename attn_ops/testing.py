"""Test and benchmark helpers: named serving scenarios, random paged batches, the tolerance
policy. Used by the registry-generated test matrix, the GPU scripts and the benchmarks.

Tolerance policy (written once, declared per dtype, not tuned per test): a backend's max abs
error against REFERENCE run in fp64 must be at most ``2 x`` the error of REFERENCE run at the
test's own precision (inputs identical, compute fp32, output rounded to the dtype), plus a small
``EPSILON[dtype]``. A quantized KV cache is additionally judged by SQNR against the
unquantized result (:data:`MIN_SQNR_DB`); a TurboQuant cache's REFERENCE runs over the keys and
values its slots read back as (:meth:`PagedCase.read_back`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attn_ops.kv_cache import BlockAllocator, allocate_kv_cache, kv_cache_update
from attn_ops.metadata import CommonAttentionMetadata, build_batch, build_common_metadata
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

__all__ = ["SCENARIOS", "Scenario", "PagedCase", "make_case", "run_backend", "tolerance",
           "sqnr_db", "FEATURE_SPECS", "EPSILON", "FP8_MIN_SQNR_DB", "MIN_SQNR_DB",
           "option_variants",
           "compiled_and_eager_layer", "assert_matches_reference", "random_decode_batch",
           "capture_graph", "random_kv", "freed_pages_case"]

EPSILON = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
FP8_MIN_SQNR_DB = {KVCacheDType.FP8_E4M3: 25.0, KVCacheDType.FP8_E5M2: 18.0}
# TurboQuant's presets, attention outputs against the unquantized ones on the matrix's random
# K/V, 3 dB below the lowest the CPU matrix gives (head dim 16; k8v4 22.4 dB, 4bit_nc 19.1,
# k3v4_nc 15.1, 3bit_nc 12.2, each on its worst scenario)
MIN_SQNR_DB = {**FP8_MIN_SQNR_DB, KVCacheDType.TURBOQUANT_K8V4: 19.0,
               KVCacheDType.TURBOQUANT_4BIT_NC: 16.0, KVCacheDType.TURBOQUANT_K3V4_NC: 12.0,
               KVCacheDType.TURBOQUANT_3BIT_NC: 9.0}


@dataclass(frozen=True)
class Scenario:
    """A batch shape: ``(context_len, query_len)`` per request, decode-first."""

    requests: tuple[tuple[int, int], ...]
    shuffle_pages: bool = True
    poison_unused: bool = True  # NaN in every slot before the batch is written (tails too)
    pad_tokens: int = 0  # extra query rows past the batch (a CUDA-graph-padded batch)
    decode_threshold: int = 1  # query lengths counted as decodes (speculative decoding: > 1)


SCENARIOS = {
    "decode_only": Scenario(((17, 1), (5, 1), (33, 1), (1, 1))),
    "prefill_only": Scenario(((0, 13), (0, 7), (0, 21))),
    "mixed": Scenario(((9, 1), (30, 1), (0, 11), (6, 9))),  # decodes, prefill, chunked prefill
    "long_context": Scenario(((300, 1), (257, 1), (200, 6))),
    "single_token": Scenario(((0, 1),)),
    "contiguous_pages": Scenario(((12, 1), (0, 9), (5, 4)), shuffle_pages=False),
    "permuted_pages_nan_poisoned": Scenario(((23, 1), (14, 3), (0, 18)), shuffle_pages=True),
    "padded_batch": Scenario(((19, 1), (7, 1), (0, 5)), pad_tokens=3),
    # speculative decoding: decodes verify up to 3 draft tokens (query lengths 1-4)
    "spec_decodes": Scenario(((21, 4), (9, 1), (30, 3), (2, 2), (0, 10)), decode_threshold=4),
    "spec_decodes_only": Scenario(((40, 3), (7, 4), (18, 1)), decode_threshold=4),
}


def _on(**changes):
    return lambda s: s.with_(**changes)


FEATURE_SPECS = {
    # Feature -> how to turn it on in a base spec (small values so windows really cut).
    Feature.SLIDING_WINDOW: _on(sliding_window=7),
    Feature.SOFT_CAP: _on(logits_soft_cap=5.0),
    Feature.SINKS: _on(has_sinks=True),
    Feature.ALIBI: _on(use_alibi=True),
    Feature.NON_CAUSAL: _on(attn_type=AttentionType.ENCODER_ONLY),
    Feature.DIFF_HEAD_DIM_V: lambda s: s.with_(head_dim_v=s.head_dim + 16),
    Feature.FP8_KV: _on(kv_cache_dtype=KVCacheDType.FP8_E4M3),
}


@dataclass
class PagedCase:
    """One batch with its cache filled, ready for any backend's op."""

    spec: AttentionSpec
    metadata: CommonAttentionMetadata
    query: torch.Tensor
    kv_cache: torch.Tensor
    sinks: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    # Unquantized K/V of every token per request, for fp8 SQNR checks.
    dense_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def to(self, dtype: torch.dtype) -> PagedCase:
        """The same case with query (and an unquantized cache) in ``dtype``."""
        quantized = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
        cache = self.kv_cache if self.kv_cache.dtype in quantized else self.kv_cache.to(dtype)
        return PagedCase(self.spec.with_(dtype=dtype), self.metadata, self.query.to(dtype), cache,
                         self.sinks, self.alibi_slopes, self.k_scale, self.v_scale, self.dense_kv)

    def read_back(self, dtype: torch.dtype) -> PagedCase:
        """:meth:`to` ``dtype``; a TurboQuant cache read back into an unquantized one in
        ``dtype`` (every key and value as its slot reads), which REFERENCE takes."""
        case = self.to(dtype)
        if not self.spec.kv_cache_dtype.is_turboquant:
            return case
        from attn_ops.backends.turboquant.ops import turboquant_dense_cache

        dense = turboquant_dense_cache(self.kv_cache, self.spec.kv_cache_dtype.value,
                                       self.spec.head_dim, dtype)
        return PagedCase(case.spec.with_(kv_cache_dtype=KVCacheDType.AUTO), case.metadata,
                         case.query, dense, case.sinks, case.alibi_slopes, None, None,
                         case.dense_kv)


def make_case(spec: AttentionSpec, scenario: Scenario, *, block_size: int = 4,
              num_blocks: int | None = None, device: str = "cpu", seed: int = 0) -> PagedCase:
    """A random batch for ``spec``: the cache NaN-poisoned first if the scenario says so (every
    slot: unused pages, page tails, what an earlier request could have left), then contexts and
    new tokens written through ``torch.ops.attn.kv_cache_update`` as a serving engine writes
    them."""
    g = torch.Generator().manual_seed(seed)
    ctx = [c for c, _ in scenario.requests]
    qlens = [q for _, q in scenario.requests]
    needed = sum(-(-(c + q) // block_size) for c, q in scenario.requests)
    num_blocks = num_blocks or needed + 8
    alloc = BlockAllocator(num_blocks, block_size, shuffle=scenario.shuffle_pages, seed=seed)
    meta = build_batch(alloc, list(range(len(ctx))), ctx, qlens, device=device,
                       num_tokens_padded=sum(qlens) + scenario.pad_tokens,
                       decode_threshold=scenario.decode_threshold)
    fp8 = spec.kv_cache_dtype.is_fp8

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(spec.dtype).to(device)

    cache = allocate_kv_cache(spec, num_blocks, block_size, device)
    turboquant = spec.kv_cache_dtype.is_turboquant
    if scenario.poison_unused:  # (a TurboQuant slot of 0xFF bytes reads as NaN K and V)
        cache.fill_(0xFF if turboquant else float("nan"))
    scales = (torch.tensor([0.05], device=device), torch.tensor([0.04], device=device)) \
        if fp8 else (None, None)
    dense, starts = [], meta.query_start_loc_cpu.tolist()
    for i, (c, q) in enumerate(scenario.requests):
        k, v = randn(c + q, spec.kv_heads, spec.head_dim), randn(c + q, spec.kv_heads,
                                                                 spec.v_head_dim)
        dense.append((k, v))
        slots = torch.tensor(alloc.slots(i, 0, c + q), device=device)
        if turboquant:
            from attn_ops.backends.turboquant.ops import turboquant_cache_update

            turboquant_cache_update(k, v, cache, slots, spec.kv_cache_dtype.value)
        else:
            kv_cache_update(k, v, cache, slots, *scales)
    query = randn(starts[-1] + scenario.pad_tokens, spec.num_heads, spec.head_dim)
    sinks = torch.randn(spec.num_heads, generator=g).to(device) if spec.has_sinks else None
    slopes = None
    if spec.use_alibi:
        from attn_ops.layers.attention import alibi_slopes
        slopes = alibi_slopes(spec.num_heads).to(device)
    return PagedCase(spec, meta, query, cache, sinks, slopes, *scales, dense_kv=dense)


def option_variants(name: str) -> tuple[tuple[str, dict], ...]:
    """``(id, constructor options)`` that route batches to other kernels (or ops) of backend
    ``name`` -- tunings, mostly: the matrix and the op checks run each besides the default."""
    from attn_ops.tuning import GENERIC, MEASURED

    h200 = MEASURED["H200"]
    return {
        # the generic tuning: FlashInfer's decode only; the H200's: FA4 and TRITON_ATTN too
        "COMPOSITE_SM90": (("generic_tuning", {"tuning": GENERIC}),
                           ("h200_tuning", {"tuning": h200})),
        "TRITON_ATTN": (("combine_kernel", {"tuning": h200.with_(
                            triton={"fused_combine": False})}),
                        ("fused_combine", {"tuning": h200.with_(
                            triton={"fused_combine": True})})),
    }.get(name, ())


def run_backend(backend_cls, case: PagedCase, *, with_lse: bool = True,
                **options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one backend (constructed with ``options``) on a case the way a model does (build
    its metadata, call its op); returns ``(out, lse)``, NaN-initialized so unwritten rows show."""
    spec, q = case.spec, case.query
    out = torch.full((q.shape[0], spec.num_heads, spec.v_head_dim), float("nan"), dtype=q.dtype,
                     device=q.device)
    lse = torch.full((q.shape[0], spec.num_heads), float("nan"), device=q.device) \
        if with_lse else None
    backend_cls(spec, **options).forward(
        q, case.kv_cache, case.metadata, out, lse=lse, sinks=case.sinks,
        alibi_slopes=case.alibi_slopes, k_scale=case.k_scale, v_scale=case.v_scale)
    return out, lse


def assert_matches_reference(out: torch.Tensor, case: PagedCase,
                             oracle: PagedCase | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Assert ``out`` (a backend's rows for ``case``) is within :func:`tolerance` of REFERENCE
    run in fp64 on ``oracle`` (default ``case``; e.g. the same batch with an explicit mask);
    returns REFERENCE's fp64 ``(out, lse)``."""
    from attn_ops.registry import get_backend_class

    reference = get_backend_class("REFERENCE")
    oracle = oracle or case
    n = case.metadata.num_actual_tokens
    truth, truth_lse = run_backend(reference, oracle.to(torch.float64))
    base, _ = run_backend(reference, oracle.to(case.spec.dtype))  # plain torch, same precision
    err = (out[:n].double() - truth[:n]).abs().max().item()
    allowed = tolerance((base[:n].double() - truth[:n]).abs().max().item(), case.spec.dtype)
    assert err <= allowed, f"max error {err:.3g} > allowed {allowed:.3g}"
    return truth, truth_lse


def random_decode_batch(n: int, num_blocks: int, rng, block_size: int, max_len: int, *,
                        qlen: int = 1, device="cpu") -> CommonAttentionMetadata:
    """``n`` requests of ``qlen`` new tokens, lengths drawn from ``rng`` (a
    :class:`random.Random`) in ``[qlen, max_len]``, each over distinct pages in random order;
    page 0 stays unused (CUDA-graph padding rows point at it)."""
    pages = list(range(1, num_blocks))
    rng.shuffle(pages)
    seq = [rng.randint(qlen, max_len) for _ in range(n)]
    tables, at = [], 0
    for length in seq:
        count = -(-length // block_size)
        tables.append(pages[at:at + count])
        at += count
    return build_common_metadata([qlen] * n, seq, tables, block_size, num_blocks, device=device)


def random_kv(spec: AttentionSpec, n: int, generator: torch.Generator, poison: float | None = None,
              device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` tokens' random K and V ``[n, kv_heads, head_dim(_v)]`` in the spec's dtype; with
    ``poison`` every other key element (every other value element from the second) set to it
    and every third to +Inf (values: -Inf) -- a request whose pages must never reach another."""
    k = torch.randn(n, spec.kv_heads, spec.head_dim, generator=generator)
    v = torch.randn(n, spec.kv_heads, spec.v_head_dim, generator=generator)
    if poison is not None:
        k.view(-1)[::2], v.view(-1)[1::2] = poison, poison
        k.view(-1)[1::3], v.view(-1)[::3] = float("inf"), float("-inf")
    return k.to(spec.dtype).to(device), v.to(spec.dtype).to(device)


def freed_pages_case(spec: AttentionSpec, block_size: int, num_blocks: int, layout,
                     b_new: int = 1, device="cpu") -> PagedCase:
    """Request A writes NaN and +-Inf K/V (:func:`random_kv`) over five pages and three tokens
    and is freed; B (a first chunk of two pages and a token, then ``b_new`` tokens) and C (a
    fresh prefill of a page and two tokens) get A's pages back -- the allocator hands freed
    blocks out again -- and end mid-page, their K/V written through the cache-write op: the B
    + C step as a case over a ``layout`` cache (queries B's new tokens, then C's)."""
    from attn_ops.kv_cache import BlockAllocator, allocate_kv_cache, kv_cache_update
    from attn_ops.metadata import build_batch

    alloc = BlockAllocator(num_blocks, block_size, shuffle=True, seed=3)
    cache = allocate_kv_cache(spec, num_blocks, block_size, device, layout)
    g = torch.Generator().manual_seed(0)
    a_len = 5 * block_size + 3
    write = build_batch(alloc, ["A"], [0], [a_len], device=device)
    kv_cache_update(*random_kv(spec, a_len, g, float("nan"), device), cache, write.slot_mapping,
                    None, None)
    alloc.free("A")
    b_ctx, c_len = 2 * block_size + 1, block_size + 2
    step = build_batch(alloc, ["B"], [0], [b_ctx], device=device)
    kv_cache_update(*random_kv(spec, b_ctx, g, device=device), cache, step.slot_mapping, None,
                    None)
    step = build_batch(alloc, ["B", "C"], [b_ctx, 0], [b_new, c_len], device=device)
    kv_cache_update(*random_kv(spec, b_new + c_len, g, device=device), cache,
                    step.slot_mapping, None, None)
    query = torch.randn(b_new + c_len, spec.num_heads, spec.head_dim, generator=g)
    return PagedCase(spec, step, query.to(spec.dtype).to(device), cache, None, None, None,
                     None)


def capture_graph(fn):
    """``(graph, out)``: ``fn()`` run once on a side stream (lazy compiles, plans and
    allocations stay out of the capture), then captured in a CUDA graph; ``out`` is what the
    captured call returned (its tensors are the graph's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def tolerance(baseline_error: float, dtype: torch.dtype) -> float:
    """The policy: ``2 x`` plain-torch error at the same precision, plus epsilon."""
    return 2.0 * baseline_error + EPSILON[dtype]


def sqnr_db(result: torch.Tensor, truth: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``result`` against ``truth``."""
    noise = (result.double() - truth.double()).pow(2).mean()
    return float(10 * torch.log10(truth.double().pow(2).mean() / noise))


def compiled_and_eager_layer(spec: AttentionSpec, backend: str, scenario: Scenario, *,
                             device: str = "cpu", seed: int = 1, tuning=None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(compiled, eager)`` outputs of one :class:`~attn_ops.layers.attention.Attention` layer
    forced to ``backend`` on a random ``scenario`` batch (new K/V written by the layer): once
    through ``torch.compile(fullgraph=True)``, once eagerly on a copy of the cache."""
    from attn_ops.layers.attention import Attention
    from attn_ops.selector import AttentionConfig

    attn = Attention(spec, AttentionConfig(backend=backend, tuning=tuning)).to(device)
    case = make_case(spec, scenario, block_size=attn.block_size, device=device, seed=seed)
    t = case.query.shape[0]
    k = torch.randn(t, spec.kv_heads, spec.head_dim, device=device).to(spec.dtype)
    v = torch.randn(t, spec.kv_heads, spec.v_head_dim, device=device).to(spec.dtype)
    expected = attn(case.query, k, v, case.kv_cache.clone(), case.metadata)
    torch._dynamo.reset()
    got = torch.compile(attn, fullgraph=True)(case.query, k, v, case.kv_cache, case.metadata)
    return got, expected
