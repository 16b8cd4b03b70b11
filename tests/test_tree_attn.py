"""TREE_ATTN: draft-tree requests (each query sees the committed prefix and its ancestors only)
mixed with plain decodes and prefills in one batch, against REFERENCE given the equivalent
explicit mask (a mask_mod built from the same tree). CPU: Triton's interpreter."""

import dataclasses

import pytest
import torch

from attn_ops import AttentionSpec, current_platform, get_backend_class, select_backend
from attn_ops.testing import Scenario, assert_matches_reference, make_case, run_backend

PLATFORM = current_platform()
DEVICE = PLATFORM.device_type
TREE = get_backend_class("TREE_ATTN")
REFERENCE = get_backend_class("REFERENCE")
DTYPE = torch.float16 if PLATFORM.is_gpu else torch.float32
# root; two children; a grandchild under each; one great-grandchild: 6 nodes
PARENTS = (-1, 0, 0, 1, 2, 3)
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=DTYPE, spec_tree=PARENTS)
pytestmark = pytest.mark.skipif(bool(TREE.not_supported_reasons(SPEC, PLATFORM)),
                                reason="TREE_ATTN cannot run here (no Triton, or CPU without "
                                       "TRITON_INTERPRET=1)")


def ancestors(parents):
    out = []
    for i, p in enumerate(parents):
        out.append({i} | (out[p] if p >= 0 else set()))
    return out


def explicit_mask(case, parents):
    """The tree as a REFERENCE mask_mod: for a request with exactly len(parents) queries, a
    draft token sees the prefix and its ancestors."""
    seq = case.metadata.seq_lens_cpu.tolist()
    qlen = case.metadata.query_lens_cpu.tolist()
    n = len(parents)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i, anc in enumerate(ancestors(parents)):
        allowed[i, list(anc)] = True
    is_tree = torch.tensor([q == n for q in qlen])
    context = torch.tensor([s - q for s, q in zip(seq, qlen)])
    allowed, is_tree, context = (t.to(DEVICE) for t in (allowed, is_tree, context))

    def mask_mod(request, head, q_pos, kv_pos):
        ctx = context[request]
        qi = (q_pos - ctx).clamp(0, n - 1)
        kj = (kv_pos - ctx).clamp(0, n - 1)
        in_drafts = kv_pos >= ctx
        return ~is_tree[request] | ~in_drafts | allowed[qi, kj]
    return mask_mod


@pytest.mark.parametrize("variant", ["plain", "sinks_softcap", "window"])
def test_tree_requests_see_only_their_ancestors(variant):
    spec = {"plain": SPEC, "sinks_softcap": SPEC.with_(has_sinks=True, logits_soft_cap=6.0),
            "window": SPEC.with_(sliding_window=20)}[variant]
    # decodes, two tree requests (6 queries), a prefill
    scenario = Scenario(((40, 1), (3, 1), (25, 6), (70, 6), (0, 9)))
    case = make_case(spec, scenario, block_size=16, device=DEVICE, seed=9)
    n = case.metadata.num_actual_tokens
    out, lse = run_backend(TREE, case)
    oracle = dataclasses.replace(case, spec=spec.with_(spec_tree=None,
                                                       mask_mod=explicit_mask(case, PARENTS)))
    truth, truth_lse = assert_matches_reference(out, case, oracle)
    assert (lse[:n].double() - truth_lse[:n]).abs().max().item() < 1e-3
    causal = case.to(torch.float64)
    causal.spec = causal.spec.with_(spec_tree=None)
    plain, _ = run_backend(REFERENCE, causal)
    assert (plain[:n] - truth[:n]).abs().max() > 1e-3, "the tree mask must change the result"


def test_a_tree_selects_tree_attn_and_bad_trees_are_refused():
    if PLATFORM.is_gpu:
        assert select_backend(SPEC, PLATFORM).backend == "TREE_ATTN"
    with pytest.raises(ValueError, match="spec_tree=.* must list 1-64 parents"):
        AttentionSpec(num_heads=4, head_dim=32, spec_tree=(0, -1))
    with pytest.raises(ValueError, match="must list 1-64 parents"):
        AttentionSpec(num_heads=4, head_dim=32, spec_tree=(-1, 2, 0))
    reasons = [r.code for r in TREE.not_supported_reasons(SPEC.with_(spec_tree=None), PLATFORM)]
    assert "feature:tree" in reasons


@pytest.mark.parametrize("with_lse", [True, False])
def test_tree_op_passes_opcheck(with_lse):
    case = make_case(SPEC, Scenario(((12, 1), (20, 6))), block_size=16, device=DEVICE, seed=2)
    impl = TREE(SPEC)
    out = torch.empty(case.query.shape[0], 4, 32, dtype=DTYPE, device=DEVICE)
    lse = torch.empty(case.query.shape[0], 4, device=DEVICE) if with_lse else None
    meta = impl.build_metadata(case.metadata)
    torch.library.opcheck(impl.op_for(meta), impl.op_arguments(case.query, case.kv_cache, meta,
                                                               out, lse=lse))


def test_a_tree_given_as_its_ancestor_mask_is_the_same_tree():
    from attn_ops.spec import AttentionSpec

    parents = (-1, 0, 0, 1, 1, 2)
    mask = [[0] * 6 for _ in range(6)]
    for i, p in enumerate(parents):  # row i: i itself and its ancestors
        j = i
        while j >= 0:
            mask[i][j] = 1
            j = parents[j]
    base = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    assert base.with_(spec_tree=mask).spec_tree == parents
    assert base.with_(spec_tree=torch.tensor(mask, dtype=torch.bool)).spec_tree == parents
    mask[3][2] = 1  # node 3 also "sees" node 2, which is not its ancestor
    with pytest.raises(ValueError, match="mask row 3 marks"):
        base.with_(spec_tree=mask)
    with pytest.raises(ValueError, match="must mark node 0 itself"):
        base.with_(spec_tree=[[0, 0], [1, 1]])


def test_a_freed_requests_nan_and_inf_never_reach_a_tree_request():
    """Request A writes NaN and +-Inf K/V over several pages and is freed; request B (its
    context in a first chunk, then a draft tree) and C (a fresh prefill) get A's pages back --
    the allocator hands freed blocks out again -- and end mid-page. TREE_ATTN's outputs must be
    finite and REFERENCE's under the tree's explicit mask."""
    from attn_ops.testing import freed_pages_case

    case = freed_pages_case(SPEC, 16, 24, TREE.kv_cache_layout(SPEC), b_new=len(PARENTS),
                            device=DEVICE)
    out, _ = run_backend(TREE, case)
    assert out[:case.query.shape[0]].isfinite().all(), "a freed request's NaN/Inf reached B or C"
    oracle = dataclasses.replace(case, spec=SPEC.with_(spec_tree=None,
                                                       mask_mod=explicit_mask(case, PARENTS)))
    assert_matches_reference(out, case, oracle)
