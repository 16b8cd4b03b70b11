"""Whole-model CUDA graphs (GPU): a compiled TinyLlama (our fusion passes installed, alternating
sliding-window layers) replayed 200 times with random batch compositions and lengths, every
replay compared with the eager model on a copy of the same caches.

* full graphs: :class:`attn_ops.cudagraph.CUDAGraphRunner` over single-token decode batches
  (TREE_ATTN: draft-tree verification batches, every request the tree's nodes), for every GPU
  backend that replays them;
* piecewise: ``torch.compile(mode="reduce-overhead")`` with Inductor's graph partitioning
  around the attention ops a graph cannot hold (:func:`attn_ops.cudagraph.partition_ops`), over
  mixed batches (decodes + prefills) padded to a fixed token count.
"""

import dataclasses
import random

import pytest
import torch

from attn_ops import AttentionConfig, build_step_metadata, get_backend_class
from attn_ops.capabilities import CUDAGraphSupport
from attn_ops.kv_cache import BlockAllocator
from attn_ops.metadata import build_batch
from attn_ops.models.llama import ModelConfig, TinyLlama
from attn_ops.platforms import current_platform

PLATFORM = current_platform()
CFG = ModelConfig(vocab_size=256, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                  head_dim=64, intermediate_size=512, dtype=torch.float16, sliding_window=48,
                  sliding_window_every=2)
# FLASH_ATTN_DIFFKV serves models whose V head dim differs from Q/K's; TREE_ATTN draft trees
DIFFV_CFG = dataclasses.replace(CFG, head_dim_v=80)
TREE_CFG = dataclasses.replace(CFG, spec_tree=(-1, 0, 0, 1))
STEPS = 200
MAX_CTX = 300


def _backends(needed):
    """``(backend, model config)`` params for every GPU backend of the registry that runs the
    model's layers at CUDA-graph level ``needed``."""
    if not PLATFORM.is_gpu:
        return []
    params = []
    for name, cfg in (("FLASHINFER", CFG), ("FLASH_ATTN", CFG), ("FLASH_ATTN_DIFFKV", DIFFV_CFG),
                      ("TRITON_ATTN", CFG), ("TREE_ATTN", TREE_CFG), ("FLEX_ATTENTION", CFG),
                      ("REFERENCE", CFG)):
        try:
            cls = get_backend_class(name)
        except ImportError:
            continue
        specs = [cfg.attention_spec(i) for i in range(cfg.num_layers)]
        if all(not cls.not_supported_reasons(s, PLATFORM) for s in specs) and all(
                cls.cudagraph_support(s, PLATFORM) >= needed for s in specs):
            params.append(pytest.param(name, cfg, id=name))
    return params


def _models(backend, cfg):
    """The model, a block allocator and two identical random cache sets (eager / graphed)."""
    torch.manual_seed(0)
    model = TinyLlama(cfg, AttentionConfig(backend=backend)).cuda().to(cfg.dtype).eval()
    width = -(-(MAX_CTX + 64) // model.block_size)
    alloc = BlockAllocator(16 * width + 64, model.block_size, shuffle=True, seed=1)
    eager = model.allocate_kv_caches(alloc.num_blocks, "cuda")
    for cache in eager:
        cache.copy_(torch.randn(cache.shape, device="cuda").to(cache.dtype))
    return model, alloc, width, eager, [c.clone() for c in eager]


def _with_our_passes():
    """Inductor config with our fusion passes, for this test only (not installed globally)."""
    import torch._inductor.config as inductor_config

    from attn_ops.compile_passes import AttnPassManager, fusion_passes

    return inductor_config.patch(post_grad_custom_post_pass=AttnPassManager(fusion_passes()))


def _compare(got, want, step):
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2,
                               msg=lambda m: f"replay {step}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,cfg", _backends(CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE))
def test_full_graphs_replay_random_decode_batches_like_eager(backend, cfg):
    from attn_ops.cudagraph import CUDAGraphBatch, CUDAGraphRunner

    model, alloc, width, eager_caches, graph_caches = _models(backend, cfg)
    qlen = len(cfg.spec_tree) if cfg.spec_tree else 1  # (a tree's verification: all its nodes)
    graphs = CUDAGraphBatch((1, 4, 16), width, model.block_size, "cuda", uniform_query_len=qlen)
    torch._dynamo.reset()
    runner = CUDAGraphRunner(model, torch.compile(model, fullgraph=True), graphs, graph_caches)
    rng = random.Random(0)
    with torch.no_grad(), _with_our_passes():
        for step in range(STEPS):
            n = rng.randint(1, 16)
            ids = [f"{step}:{i}" for i in range(n)]
            common = build_batch(alloc, ids, [rng.randint(1, MAX_CTX) for _ in ids], [qlen] * n,
                                 device="cuda", max_blocks_per_req=width)
            tokens = torch.randint(0, cfg.vocab_size, (n * qlen,), device="cuda")
            want = model(tokens, common.positions, eager_caches,
                         build_step_metadata(model, common))
            _compare(runner(tokens, common), want, step)
            for r in ids:
                alloc.free(r)
    assert len(runner.captured) <= 3  # one graph per capture size, never re-captured


@pytest.mark.gpu
@pytest.mark.parametrize("backend,cfg", _backends(CUDAGraphSupport.NEVER))
def test_piecewise_graphs_replay_random_mixed_batches_like_eager(backend, cfg):
    import torch._inductor.config as inductor_config

    from attn_ops.cudagraph import partition_ops

    model, alloc, width, eager_caches, graph_caches = _models(backend, cfg)
    for cache in graph_caches:  # graphs may mutate only static inputs
        torch._dynamo.mark_static_address(cache)
    padded = 64
    rng = random.Random(1)
    torch._dynamo.reset()
    with torch.no_grad(), _with_our_passes(), inductor_config.patch(
            graph_partition=True, custom_should_partition_ops=partition_ops(model)):
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for step in range(STEPS):
            decodes = rng.randint(0, 8)
            prefills = [rng.randint(2, 24) for _ in range(rng.randint(0 if decodes else 1, 2))]
            qlens = [1] * decodes + prefills
            ids = [f"{step}:{i}" for i in range(len(qlens))]
            ctx = [rng.randint(1, MAX_CTX) for _ in range(decodes)] + \
                [rng.choice([0, rng.randint(1, MAX_CTX // 2)]) for _ in prefills]
            common = build_batch(alloc, ids, ctx, qlens, device="cuda",
                                 max_blocks_per_req=width, num_tokens_padded=padded)
            tokens = torch.randint(0, cfg.vocab_size, (padded,), device="cuda")
            n = common.num_actual_tokens
            want = model(tokens, common.positions, eager_caches,
                         build_step_metadata(model, common))
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(tokens, common.positions, graph_caches,
                           build_step_metadata(model, common))
            _compare(got[:n], want[:n], step)
            for r in ids:
                alloc.free(r)
