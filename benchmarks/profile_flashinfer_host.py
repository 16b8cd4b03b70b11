"""Host (Python) cost of FLASHINFER's op body and eager metadata builder, with FlashInfer's own
calls replaced by no-ops -- so it runs on any CPU and isolates *our* code's share of the eager
per-call and per-step overhead (the dispatcher, FlashInfer's C++ plan and the CUDA launches are
not in it; ``bench_gpu_attention.py`` measures the whole on the H200).

    python benchmarks/profile_flashinfer_host.py [--out PATH] [--cprofile]

Decode batch of 256 requests at ctx 4k, page 128, Llama-3-8B heads: steps that must replan
(some request entered a new page) and steps whose page counts are unchanged (the plan in the
workspace is reused); op body: one decode call; then a CUDA-graph decode step's host
preparation (:func:`graph_step_us`). ``--cprofile``: also print where a replanning builder
step spends its time.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_us, run_info, write_json  # noqa: E402


def mean_us(fn, n=5000) -> float:
    return host_us(fn, n, warmup=100)


class _NoOpModule:
    def plan(self, *args):
        return list(range(15))

    def paged_run(self, *args):
        pass


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass


def graph_step_us(spec, tuning, facts) -> dict[str, float]:
    """A CUDA-graph decode step's host preparation at B=64, ctx 2k, page 16 (as in
    ``bench_model_decode.py``'s graphed step): the batch (allocator + common metadata), its
    padding into the persistent buffers, FLASHINFER's graph metadata (past the split budget:
    the plan is kept), and ``build_step_metadata`` for an 8-layer model given the model
    (walking its modules) or ``step_backends`` (on a CPU "device": no copies are timed)."""
    from attn_ops import AttentionConfig, build_step_metadata, step_backends
    from attn_ops.backends.flashinfer_plan import GraphPlanner
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.kv_cache import BlockAllocator
    from attn_ops.metadata import build_batch
    from attn_ops.models.llama import ModelConfig, TinyLlama

    b, ctx, page = 64, 2048, 16
    width = -(-(ctx + 1) // page)
    alloc = BlockAllocator(b * width + 1, page, shuffle=True)
    ids = list(range(b))
    for r in ids:
        alloc.reserve(r, ctx)
    graphs = CUDAGraphBatch((b,), width, page, "cpu")
    planner = GraphPlanner(spec, graphs, tuning, facts=facts)

    def batch():
        return build_batch(alloc, ids, [ctx - 1] * b, [1] * b, max_blocks_per_req=width)

    common = batch()
    padded = graphs.pad(common)
    model = TinyLlama(ModelConfig(num_layers=8, hidden_size=64, num_heads=4, num_kv_heads=2,
                                  head_dim=16, intermediate_size=64, vocab_size=32),
                      AttentionConfig(backend="REFERENCE"))
    backends = step_backends(model)
    return {"graph_step_build_batch_us": mean_us(batch, 2000),
            "graph_step_pad_us": mean_us(lambda: graphs.pad(common), 2000),
            "graph_step_flashinfer_graph_planner_us": mean_us(lambda: planner(padded), 2000),
            "build_step_metadata_8_layers_given_the_model_us":
                mean_us(lambda: build_step_metadata(model, common), 2000),
            "build_step_metadata_8_layers_given_step_backends_us":
                mean_us(lambda: build_step_metadata(backends, common), 2000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "profile_flashinfer_host.json"))
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    from attn_ops import AttentionSpec
    from attn_ops.backends import flashinfer as fi
    from attn_ops.backends import flashinfer_plan
    from attn_ops.backends.flashinfer_plan import PART, PartPlan, paged_kv_csr
    from attn_ops.metadata import build_common_metadata
    from attn_ops.routing import DeviceFacts, Kernel
    from attn_ops.tuning import MEASURED

    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    batch, ctx, page = 256, 4096, 128
    pages = ctx // page
    perm = torch.randperm(batch * pages + 1).tolist()
    tables = [perm[i * pages:(i + 1) * pages] for i in range(batch)]
    meta = build_common_metadata([1] * batch, [ctx] * batch, tables, page, batch * pages + 1)
    # the next step, with one request in a new page (FlashInfer must plan again)
    longer = build_common_metadata([1] * batch, [ctx + 1] + [ctx] * (batch - 1),
                                   [tables[0] + [batch * pages]] + tables[1:], page,
                                   batch * pages + 1)
    real_empty = torch.empty

    def host_empty(*a, pin_memory=False, **k):  # (no pinned memory without CUDA)
        return real_empty(*a, **k)

    # The H200's tuning and SM count, on a CPU "device" (FlashInfer's modules are no-ops).
    tuning, facts = MEASURED["H200"], DeviceFacts(132, (9, 0))

    def no_op_module(*args):
        return _NoOpModule()

    with mock.patch.object(flashinfer_plan, "flashinfer_module", no_op_module), \
            mock.patch.object(fi, "flashinfer_module", no_op_module), \
            mock.patch.object(torch.cuda, "Event", _Event), \
            mock.patch.object(torch, "empty", host_empty), \
            mock.patch.object(DeviceFacts, "of", lambda device: facts):
        planner = fi.FlashInferBackend(spec, tuning=tuning).make_planner(torch.device("cpu"))
        # (alternating the two batches: every step replans)
        flip = [meta, longer]
        results = {"builder_us_per_step": mean_us(lambda: planner(flip.reverse() or flip[0]),
                                                  1000),
                   "builder_us_per_step_same_pages": mean_us(lambda: planner(meta), 1000),
                   "paged_kv_csr_us": mean_us(lambda: paged_kv_csr(
                       meta.seq_lens_cpu, meta.block_table_cpu, page))}
        if args.cprofile:
            import cProfile
            import pstats

            with cProfile.Profile() as prof:
                for _ in range(2000):
                    planner(flip.reverse() or flip[0])
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        q = torch.randn(1, 32, 128, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        cache = torch.randn(10, 2, 16, 8, 128, dtype=torch.bfloat16)
        ws, tables = torch.empty(16, dtype=torch.uint8), torch.zeros(6, dtype=torch.int32)
        # one decode (tables: qo_indptr at 0, kv_indptr at 2, last_page_len at 4, indices at 5)
        plan = PART.encode(PartPlan(Kernel.FLASHINFER_FA2, 1, 1, 0, False, 1, 0, 2, 4, 5, 0, 0,
                                    None, False, None, tuple(range(15))))
        none = PART.encode(PartPlan(None, 0, 0, 0, False, 0, 0, 0, 0, 0, 0, 0, None, False,
                                    None, ()))
        op_args = (q, cache, out, None, ws, tables, tables[:1], tables[:1, None], ws, plan, ws,
                   none, None, None, None, 0.088, None, None, True)
        results["op_body_us_per_call"] = mean_us(lambda: fi._flashinfer_attention(*op_args))
        results.update(graph_step_us(spec, tuning, facts))
    print({k: round(v, 2) for k, v in results.items()})
    info = run_info("profile_flashinfer_host")
    info.update(results=results, batch=batch, ctx=ctx, page=page)
    write_json(args.out, info)


if __name__ == "__main__":
    main()
