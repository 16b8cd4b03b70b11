"""The compile-pass manager appends to whatever custom pass is configured, runs it first, and
keys Inductor's cache on every sub-pass."""

import types

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from attn_ops.compile_passes.manager import AttnPassManager, install


class Recording(CustomGraphPass):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, graph):
        self.log.append((self.name, sum(1 for n in graph.nodes if n.op == "call_function")))

    def uuid(self):
        return f"recording:{self.name}".encode()


def test_install_keeps_an_existing_pass_and_runs_it_first():
    log = []
    config = types.SimpleNamespace(post_grad_custom_post_pass=Recording("user", log))
    manager = install([Recording("ours", log)], config)
    assert config.post_grad_custom_post_pass is manager
    assert install([Recording("more", log)], config) is manager  # appended, not replaced
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1).graph
    manager(graph)
    assert [name for name, _ in log] == ["user", "ours", "more"]


def test_uuid_tracks_every_pass_and_is_none_for_a_plain_function():
    a, b = Recording("a", []), Recording("b", [])
    assert AttnPassManager([a, b]).uuid() == AttnPassManager([a, b]).uuid()
    assert AttnPassManager([a, b]).uuid() != AttnPassManager([a]).uuid()
    assert AttnPassManager([a, lambda g: None]).uuid() is None


def test_inductor_runs_the_installed_passes():
    import torch._inductor.config as inductor_config

    log = []
    with inductor_config.patch(post_grad_custom_post_pass=None, fx_graph_cache=False):
        install([Recording("ours", log)])
        torch._dynamo.reset()
        fn = torch.compile(lambda x: torch.relu(x) * 2, fullgraph=True)
        x = torch.randn(8)
        torch.testing.assert_close(fn(x), torch.relu(x) * 2)
    assert log and log[0][0] == "ours" and log[0][1] >= 2


# ---------------------------------------------------------------------------------------------
# The fusion passes on a compiled TinyLlama (CPU): graph snapshots before/after, the fused
# graph against the unfused one, attention ops per layer.

import expecttest  # noqa: E402
import pytest  # noqa: E402

from attn_ops import AttentionConfig, Platform  # noqa: E402
from attn_ops.compile_passes import fusion_passes  # noqa: E402
from attn_ops.compile_passes.base import attn_ops_in, graph_text  # noqa: E402
from attn_ops.kv_cache import BlockAllocator  # noqa: E402
from attn_ops.metadata import build_batch  # noqa: E402
from attn_ops.models.llama import ModelConfig, TinyLlama  # noqa: E402


def _tiny(device_slot_mapping=True, layers=2, window=None, fp8_out=False):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, intermediate_size=64,
                      device_slot_mapping=device_slot_mapping, sliding_window=window,
                      sliding_window_every=2, fp8_attention_output=fp8_out)
    torch.manual_seed(0)
    # (the snapshots' op, on the CPU also on a GPU machine)
    model = TinyLlama(cfg, AttentionConfig(backend="CPU_ATTN"), Platform.parse("cpu")).eval()
    alloc = BlockAllocator(32, model.block_size, shuffle=True, seed=2)
    # two decodes, a prefill and a chunked prefill, 2 padding tokens
    meta = build_batch(alloc, [0, 1, 2, 3], [3, 20, 0, 6], [1, 1, 5, 4], num_tokens_padded=13)
    return model, meta, torch.randint(0, 64, (13,))


def _run(model, meta, ids, passes, *, v2=True):
    """Compile the whole model with ``passes`` between two graph snapshots; returns the logits,
    the caches and the attn ops / text of the graph before and after."""
    import torch._inductor.config as inductor_config

    seen = {}

    def snap(name):
        def record(graph):
            seen[name] = (attn_ops_in(graph), graph_text(graph))
        return record

    caches = model.allocate_kv_caches(32, "cpu")
    manager = AttnPassManager([snap("before"), *passes, snap("after")])
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(post_grad_custom_post_pass=manager,
                                                fx_graph_cache=False,
                                                enable_auto_functionalized_v2=v2):
        logits = torch.compile(model, fullgraph=True)(ids, meta.positions, caches, meta)
    return logits, caches, seen["before"], seen["after"]


def test_passes_fold_each_layers_glue_into_one_cache_write_op():
    model, meta, ids = _tiny()
    _, _, (_, before), (_, after) = _run(model, meta, ids, fusion_passes())
    expecttest.assert_expected_inline(before, """\
rope0 = rope(_, _)
slot_mapping0 = slot_mapping(in3, in8, in7, 16)
kv_cache_update0 = kv_cache_update(key=rope0, value=_, slot_mapping=slot_mapping0) (functionalized)
rope1 = rope(_, _)
cpu_attention0 = cpu_attention(query=rope1, kv_cache=kv_cache_update0[1], query_start_loc=in8, seq_lens=in9, block_table=in7, scale=0.3535533905932738, causal=True) (functionalized)
rope2 = rope(_, _)
slot_mapping1 = slot_mapping(in3, in8, in7, 16)
kv_cache_update1 = kv_cache_update(key=rope2, value=_, slot_mapping=slot_mapping1) (functionalized)
rope3 = rope(_, _)
cpu_attention1 = cpu_attention(query=rope3, kv_cache=kv_cache_update1[1], query_start_loc=in8, seq_lens=in9, block_table=in7, scale=0.3535533905932738, causal=True) (functionalized)""")
    expecttest.assert_expected_inline(after, """\
rope_kv_cache_update0 = rope_kv_cache_update(query=_, key=_, value=_, cos_sin=_, positions=in3, query_start_loc=in8, block_table=in7) (functionalized)
cpu_attention0 = cpu_attention(query=rope_kv_cache_update0[0], kv_cache=rope_kv_cache_update0[1], query_start_loc=in8, seq_lens=in9, block_table=in7, scale=0.3535533905932738, causal=True) (functionalized)
rope_kv_cache_update1 = rope_kv_cache_update(query=_, key=_, value=_, cos_sin=_, positions=in3, query_start_loc=in8, block_table=in7) (functionalized)
cpu_attention1 = cpu_attention(query=rope_kv_cache_update1[0], kv_cache=rope_kv_cache_update1[1], query_start_loc=in8, seq_lens=in9, block_table=in7, scale=0.3535533905932738, causal=True) (functionalized)""")


@pytest.mark.parametrize("v2", [True, False], ids=["functionalized_v2", "functionalized_v1"])
@pytest.mark.parametrize("device_slots", [True, False], ids=["device_slots", "host_slots"])
def test_fused_graph_computes_what_the_unfused_one_does(v2, device_slots):
    model, meta, ids = _tiny(device_slot_mapping=device_slots, window=4, fp8_out=device_slots)
    plain, plain_caches, _, _ = _run(model, meta, ids, [], v2=v2)
    fused, fused_caches, (before, _), (after, _) = _run(model, meta, ids, fusion_passes(), v2=v2)
    assert after != before  # the passes did rewrite the graph
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)
    for a, b in zip(fused_caches, plain_caches):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with torch.no_grad():
        eager_caches = model.allocate_kv_caches(32, "cpu")
        eager = model(ids, meta.positions, eager_caches, meta)
    torch.testing.assert_close(fused[:meta.num_actual_tokens], eager[:meta.num_actual_tokens])


@pytest.mark.parametrize("device_slots", [True, False], ids=["device_slots", "host_slots"])
def test_attention_and_its_glue_are_two_ops_per_layer_after_the_passes(device_slots):
    layers = 4
    model, meta, ids = _tiny(device_slot_mapping=device_slots, layers=layers)
    _, _, (before, _), (after, _) = _run(model, meta, ids, fusion_passes())
    per_layer = {"rope": 2, "kv_cache_update": 1, "cpu_attention": 1}
    expected_before = {op: n * layers for op, n in per_layer.items()}
    if device_slots:
        expected_before["slot_mapping"] = layers  # (no CSE in inference graphs here)
    assert {op: before.count(op) for op in set(before)} == expected_before
    assert {op: after.count(op) for op in set(after)} == {"rope_kv_cache_update": layers,
                                                          "cpu_attention": layers}


def test_hoisting_keeps_one_slot_mapping_per_step():
    from attn_ops.compile_passes import HoistStepPrep

    model, meta, ids = _tiny(layers=3)
    _, _, (before, _), (after, _) = _run(model, meta, ids, [HoistStepPrep()])
    assert before.count("slot_mapping") == 3 and after.count("slot_mapping") == 1


def test_fusion_passes_have_distinct_stable_uuids_and_install_once():
    from attn_ops.compile_passes import install

    uuids = [p.uuid() for p in fusion_passes()]
    assert len(set(uuids)) == len(uuids) and uuids == [p.uuid() for p in fusion_passes()]
    config = types.SimpleNamespace(post_grad_custom_post_pass=None)
    manager = install(config)
    assert install(config) is manager and len(manager.passes) == len(uuids)


def test_fp8_output_quantization_moves_into_the_attention_op():
    from attn_ops.compile_passes import Fp8OutputFusion

    model, meta, ids = _tiny(device_slot_mapping=False, fp8_out=True)
    plain, _, _, _ = _run(model, meta, ids, [])
    fused, _, (before, _), (after, text) = _run(model, meta, ids, [Fp8OutputFusion()])
    assert before.count("quantize_fp8") == 2 and "quantize_fp8" not in after
    assert text.count("output_scale=") == 2  # each layer's attention op writes fp8
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)


def test_fp8_output_snapshot():
    from attn_ops.compile_passes import Fp8OutputFusion

    model, meta, ids = _tiny(device_slot_mapping=False, fp8_out=True, layers=1)
    _, _, (_, before), (_, after) = _run(model, meta, ids, [Fp8OutputFusion()])
    expecttest.assert_expected_inline(before, """\
rope0 = rope(_, _)
kv_cache_update0 = kv_cache_update(key=rope0, value=_, slot_mapping=in7) (functionalized)
rope1 = rope(_, _)
cpu_attention0 = cpu_attention(query=rope1, kv_cache=kv_cache_update0[1], query_start_loc=in8, seq_lens=in9, block_table=in10, scale=0.3535533905932738, causal=True) (functionalized)
quantize_fp80 = quantize_fp8(_, in11, torch.float8_e4m3fn)""")
    expecttest.assert_expected_inline(after, """\
rope0 = rope(_, _)
kv_cache_update0 = kv_cache_update(key=rope0, value=_, slot_mapping=in7) (functionalized)
rope1 = rope(_, _)
cpu_attention0 = cpu_attention(query=rope1, kv_cache=kv_cache_update0[1], query_start_loc=in8, seq_lens=in9, block_table=in10, scale=0.3535533905932738, causal=True, output_scale=in11) (functionalized)""")
