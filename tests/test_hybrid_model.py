"""The hybrid decoder (attention + Gated DeltaNet 1:3, and a Mamba2 variant) on one allocator:
chunked prefill and decode through the paged KV caches and the state slots give the logits a
single prefill of the same tokens gives; eager and torch.compile(fullgraph=True) agree."""

from __future__ import annotations

import pytest
import torch

from attn_ops.models.hybrid import HybridConfig, HybridGenerator, HybridModel
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig

PROMPTS = {0: [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], 1: [26, 43], 2: [83, 27, 95, 2, 88]}


def _model(kind: str, backend: str = "REFERENCE", platform=None) -> HybridModel:
    torch.manual_seed(0)
    cfg = HybridConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=96, vocab_size=100, linear_kind=kind)
    return HybridModel(cfg, AttentionConfig(backend=backend),
                       platform=platform or Platform.parse("cpu")).eval()


def _generate(model, forward=None, steps=6, prompts=PROMPTS):
    gen = HybridGenerator(model, 48, 5, forward)
    for r, p in prompts.items():
        gen.add(r, p)
    last = [gen.step(max_new_tokens=4) for _ in range(steps)]
    return gen, last


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "mamba1", "lightning"])
def test_chunked_prefill_and_decode_give_the_logits_of_one_prefill(kind):
    model = _model(kind)
    gen, last = _generate(model)
    tokens = {r: t for r, (t, _) in gen.requests.items()}
    assert all(len(t) > len(PROMPTS[r]) + 1 for r, t in tokens.items())  # (decodes happened)
    fresh = HybridGenerator(model, 48, 5)
    for r, t in tokens.items():
        fresh.add(r, t[:-1])
    want = fresh.step()  # everything in one prefill
    # (rows in request order in both: the last step is all decodes, this one all prefills)
    torch.testing.assert_close(last[-1], want, atol=2e-4, rtol=2e-4)
    slots = {gen.allocator.state_slot(r) for r in tokens}
    assert len(slots) == len(tokens) and 0 not in slots


# a prefill resuming mid-prompt in a mixed step, then decodes: three step shapes, three
# compiles (the last two steps share a shape)
SHORT_PROMPTS = {0: PROMPTS[0][:8], 1: PROMPTS[1], 2: PROMPTS[2][:3]}


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "mamba1", "lightning"])
def test_compiled_model_with_fullgraph_matches_eager(kind):
    model = _model(kind)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    eager_gen, eager = _generate(model, steps=4, prompts=SHORT_PROMPTS)
    comp_gen, comp = _generate(model, compiled, steps=4, prompts=SHORT_PROMPTS)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert {r: t for r, (t, _) in eager_gen.requests.items()} == \
        {r: t for r, (t, _) in comp_gen.requests.items()}


def test_state_graph_batches_pad_with_the_null_slot_and_clear_what_a_larger_step_left():
    import numpy as np

    from attn_ops.backends.ssm.metadata import StateGraphBatch, build_state_metadata
    from attn_ops.cudagraph import CUDAGraphBatch

    graphs = CUDAGraphBatch((2, 4), 8, 16, "cpu")
    states = StateGraphBatch(graphs, 64)
    big = build_state_metadata(torch.arange(4), np.array([5, 6, 7]), np.array([3, 1, 2]), 64)
    padded = states.pad(big)
    assert padded.state_indices.tolist() == [3, 1, 2, 0]
    assert padded.has_initial_state.tolist() == [True, True, True, False]
    small = build_state_metadata(torch.arange(2), np.array([9]), np.array([4]), 64)
    padded = states.pad(small)
    assert padded.state_indices.tolist() == [4, 0]
    assert states.state_indices.tolist() == [4, 0, 0, 0]  # (the larger step's rows cleared)
    assert padded.num_reqs == 2 and padded.max_query_len == 1
    prefill = build_state_metadata(torch.tensor([0, 3]), np.array([0]), np.array([1]), 64)
    with pytest.raises(ValueError, match="1 query token"):
        states.pad(prefill)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "mamba1", "lightning"])
def test_graphed_decode_steps_match_eager(kind):
    """Generation with decode steps replayed from CUDA graphs (capture sizes 2 and 4: 3
    requests pad one row onto the null slot) against the same generation run eagerly."""
    from attn_ops.platforms import current_platform

    model = _model(kind, "TRITON_ATTN", current_platform()).cuda()
    eager = HybridGenerator(model, 48, 5, device="cuda")
    graphed = HybridGenerator(model, 48, 5, device="cuda", capture_sizes=(2, 4))
    for gen in (eager, graphed):
        for r, p in PROMPTS.items():
            gen.add(r, p)
    for _ in range(8):
        want, got = eager.step(max_new_tokens=4), graphed.step(max_new_tokens=4)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert graphed.runner.captured, "no step replayed a graph"
    assert {r: t for r, (t, _) in eager.requests.items()} == \
        {r: t for r, (t, _) in graphed.requests.items()}


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "mamba1", "lightning"])
def test_a_batch_over_one_shared_prefix_computes_it_once(kind):
    """Four requests added together over one shared prefix (not block-aligned, longer than a
    step, each prompt two blocks longer): the first prefills it, its steps ending at the state
    checkpoints (every 2 blocks, its prompt's last full block, and the shared prefix's last
    block boundary, where the others resume); the others wait for that checkpoint, then
    compute only their rest -- and every request's first generated token comes from the
    logits a generator without the cache gives."""
    model = _model(kind)
    bs = model.block_size
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(100, (5 * bs + 3,), generator=g).tolist()
    prompts = {r: shared + [r + 1] * (2 * bs) for r in range(4)}

    def run(prefix_caching):
        gen = HybridGenerator(model, 128, 10, prefix_caching=prefix_caching,
                              checkpoint_every=2)
        for r, p in prompts.items():
            gen.add(r, p)
        first = {}
        while len(first) < len(prompts):
            last = gen.step(max_new_tokens=3 * bs)
            for r, row in zip(gen.step_ids, last):
                if r not in first and gen.requests[r][1] == len(prompts[r]):
                    first[r] = row
        return gen, torch.stack([first[r] for r in sorted(first)])

    cached, got = run(True)
    plain, want = run(False)
    n = len(prompts[0])
    assert cached.computed_on_add == {0: 0, 1: 5 * bs, 2: 5 * bs, 3: 5 * bs}
    assert cached.tokens_computed == n + 3 * (n - 5 * bs)
    assert plain.tokens_computed == 4 * n and not plain.waiting
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("kind", ["gated_deltanet", "mamba2", "mamba1", "lightning"])
def test_a_shared_prefix_is_computed_once_and_resumed_from_its_state_checkpoint(kind):
    """With prefix caching, a later request whose prompt starts with a cached prefix takes
    its KV blocks and the recurrent states checkpointed at its last block boundary, computes
    only the rest, and generates the logits of a generator without the cache."""
    model = _model(kind)
    bs = model.block_size
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(100, (2 * bs + 3,), generator=g).tolist()
    prompts = {0: shared + [7, 8], 1: shared + [9]}

    def run(prefix_caching):
        """Request 1's logits at each of its first four generated positions (the step rows
        of its own decodes), and the generator."""
        gen = HybridGenerator(model, 64, 6, prefix_caching=prefix_caching)
        gen.add(0, prompts[0])
        for _ in range(4):
            gen.step(max_new_tokens=bs)  # (steps end on block boundaries: checkpoints)
        gen.add(1, prompts[1])
        rows = []
        while len(rows) < 4:
            before = gen.requests[1][1]
            last = gen.step(max_new_tokens=bs)
            if gen.requests[1][1] >= len(prompts[1]) and gen.requests[1][1] > before:
                rows.append(last[1])  # (request 1 is the second row: both decode or 0 first)
        return gen, torch.stack(rows)

    cached, got = run(True)
    plain, want = run(False)
    assert cached.computed_on_add == {0: 0, 1: 2 * bs} and plain.computed_on_add == {0: 0, 1: 0}
    assert cached.allocator.blocks(1)[:2] == cached.allocator.blocks(0)[:2]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    n = len(prompts[1]) + 4
    assert cached.requests[1][0][:n] == plain.requests[1][0][:n]  # (the same tokens)
