"""Diagnostic (H200): FLEX_ATTENTION's step tables made eagerly vs inside a compiled graph, then
a compiled layer vs eager -- prints which table differs. Found torch 2.11's Inductor dropping the
offset of a sliced ``searchsorted`` boundary tensor (``a861244``; fixed in ``106143c``).

    source .gpu/bootstrap.sh && python benchmarks/exp/flexdiag.py
"""
import sys

import torch
sys.path.insert(0, "tests")
from test_flex_attention import MODS, MIXED
from attn_ops.testing import make_case
from attn_ops.backends.flex_attention import _step_tensors
spec = MODS["documents"]
case = make_case(spec, MIXED, block_size=16, device="cuda", seed=1, finite_page_tails=True)
m = case.metadata
tokens = m.slot_mapping.shape[0]
args = (m.query_start_loc, m.seq_lens, m.block_table, tokens, m.num_blocks, 16, 32, True, None,
        False)
e = _step_tensors(*args)
c = torch.compile(_step_tensors, fullgraph=True)(*args)
names = "req qpos kv_limit owner logical valid kv_num kv_idx full_num full_idx".split()
for n, a, b in zip(names, e, c):
    same = a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    print(n, tuple(a.shape), a.dtype, "same" if same else "DIFF")
    if not same:
        print("  eager   ", a.flatten()[:40].tolist()); print("  compiled", b.flatten()[:40].tolist())
from attn_ops.testing import compiled_and_eager_layer
got, exp = compiled_and_eager_layer(spec, "FLEX_ATTENTION", MIXED, device="cuda", finite_page_tails=True)
d = (got.float() - exp.float()).abs()
print("layer max diff", d.max().item(), "rows differing", (d.amax((1, 2)) > 1e-2).nonzero().flatten().tolist())
