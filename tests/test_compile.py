"""torch.compile(fullgraph=True) traces the Attention layer and the model with no graph break;
the graph names the selected backend's op; compiled equals eager; no recompiles across steps."""

import expecttest
import pytest
import torch

from attn_ops import Attention, AttentionConfig, AttentionSpec
from attn_ops.models.llama import Generator, ModelConfig, TinyLlama
from attn_ops.testing import SCENARIOS, make_case

# These run the CPU backends (fp32, tiny heads) and so run in CPU CI; on a GPU machine the
# compiled GPU paths are tested by test_cudagraph.py and test_flashinfer.py instead.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU-backend compile tests; run in CPU CI")

SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                     sliding_window=9, has_sinks=True)


class GraphRecorder:
    """A torch.compile backend that records each Dynamo graph and runs it eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self, index=-1):
        return [str(n.target).replace("<built-in method ", "").split(" of ")[0]
                for n in self.graphs[index].graph.nodes if n.op in ("call_function", "call_method")]


def _layer_inputs(backend):
    attn = Attention(SPEC, AttentionConfig(backend=backend))
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(4))
    case = make_case(SPEC, SCENARIOS["mixed"], block_size=attn.block_size)
    t = case.query.shape[0]
    k, v = torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    return attn, (case.query, k, v, case.kv_cache, case.metadata)


class TestGraphs(expecttest.TestCase):
    def test_compiled_layer_graph_contains_the_selected_backend_op(self):
        results = {}
        for backend in ("CPU_ATTN", "REFERENCE"):
            attn, (q, k, v, cache, meta) = _layer_inputs(backend)
            rec = GraphRecorder()
            compiled = torch.compile(attn, backend=rec, fullgraph=True)
            eager_cache = cache.clone()
            out = compiled(q, k, v, cache, meta)
            expected = attn(q, k, v, eager_cache, meta)
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(cache, eager_cache, equal_nan=True)
            results[backend] = rec.ops()
        self.assertExpectedInline("\n".join(f"{b}: {', '.join(ops)}" for b, ops in results.items()),
                                  """\
CPU_ATTN: attn.kv_cache_update.default, new_empty, attn.cpu_attention.default
REFERENCE: attn.kv_cache_update.default, new_empty, attn.reference_attention.default""")

    def test_inductor_layer_matches_eager(self):
        attn, (q, k, v, cache, meta) = _layer_inputs("CPU_ATTN")
        eager_cache = cache.clone()
        expected = attn(q, k, v, eager_cache, meta)
        out = torch.compile(attn, fullgraph=True)(q, k, v, cache, meta)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(cache, eager_cache, equal_nan=True)


@pytest.mark.slow
def test_compiled_model_matches_eager_with_no_recompiles_across_decode_steps():
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=128, sliding_window=12,
                      sliding_window_every=2)
    model = TinyLlama(cfg).eval()
    assert model.backends == ["CPU_ATTN", "CPU_ATTN"]
    rec = GraphRecorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True, dynamic=True)
    gens = [Generator(model, 64, compiled, max_model_len=128),
            Generator(model, 64, max_model_len=128)]
    for gen in gens:
        for rid, n in enumerate([7, 3, 12, 5]):
            gen.add(rid, list(range(n)))
    for step in range(8):
        if step == 5:  # the batch shrinks: a different batch size, same graph
            for gen in gens:
                gen.requests.pop(1)
                gen.allocator.free(1)
        (out, _), (ref, _) = gens[0].step(), gens[1].step()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(rec.graphs) == 1, f"recompiled: {len(rec.graphs)} graphs"
    assert sum("cpu_attention" in op for op in rec.ops()) == 2
    assert gens[0].requests[0].generated == gens[1].requests[0].generated


def test_no_graph_breaks_in_model():
    torch._dynamo.reset()
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=128)
    model = TinyLlama(cfg).eval()
    gen = Generator(model, 32, max_model_len=64)
    gen.add(0, [1, 2, 3])
    caches = gen.kv_caches
    from attn_ops.metadata import build_batch

    meta = build_batch(gen.allocator, [0], [0], [3], max_blocks_per_req=gen.max_blocks_per_req)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(torch.tensor([1, 2, 3]), meta.positions,
                                                   caches, meta)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
