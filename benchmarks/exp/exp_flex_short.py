"""Experiment (not a benchmark of record): where FLEX_ATTENTION's time goes in a short causal
prefill (H200, page 16, bf16, 32/8 heads, d128), next to compiled flex_attention on dense K/V.

One request of ``AB_FLEX_PREFILL`` tokens each (default 1024, 8192), every part timed as
CUDA-graph replays in one run:

* ``flex``            -- the op as the benchmark calls it (gathered layout: copy + kernel + out);
* ``gather``          -- the page copy alone; ``flex_gathered`` -- the op's attention over the
  copied cache;
* ``dense`` / ``dense_kernel`` -- compiled flex on dense K/V with / without the output copy;
* ``ours_strided`` / ``ours_contig`` -- compiled flex with FLEX's own BlockMask and mask_mod,
  over the gathered cache's K/V views / contiguous copies of them;
* ``causal_strided`` / ``causal_contig`` -- the same lists, mask_mod ``kv <= q`` (no tables);
* ``ours_strided_<option>`` -- kernel options over ``ours_strided`` (first point, with
  ``AB_FLEX_OPTIONS=1``; cde1848 measured them: none faster).

A profile of ``flex`` and ``dense`` (kernel names and CUDA times) is printed last.

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_flex_short.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_gpu_attention import Batch, SPEC, prefill_flops, time_graph  # noqa: E402
from bench_triton_attention import flex_dense  # noqa: E402

from attn_ops import get_backend_class  # noqa: E402
from attn_ops.backends import flex_attention as fa  # noqa: E402

POINTS = [int(x) for x in os.environ.get("AB_FLEX_PREFILL", "1024,8192").split(",")]
OPTIONS = {"w8": {"num_warps": 8}, "m64": {"BLOCK_M": 64}, "s2": {"num_stages": 2},
           "s4": {"num_stages": 4}, "tma": {"USE_TMA": True}, "n128w8": {"BLOCK_N": 128,
                                                                        "num_warps": 8}}


def direct(q, k, v, tables, rows, mask_mod, options):
    """Compiled flex_attention over ``k``/``v`` with FLEX's block lists and ``mask_mod``."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num, kv_idx, full_num, full_idx = tables[6:]
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                    BLOCK_SIZE=(fa.Q_BLOCK, fa.GATHER_PAGE), mask_mod=mask_mod,
                                    seq_lengths=(rows, k.shape[2]))
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    opts = {"BLOCK_N": 64, **options}

    def run():
        with torch._dynamo.config.patch(recompile_limit=256):
            return fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
    return run


def point(s, gen, first):
    b = Batch(1, s, s, 16, gen)
    impl = get_backend_class("FLEX_ATTENTION")(SPEC)
    meta = impl.build_metadata(b.meta)
    assert meta.page_map is not None, "expected the gathered layout"
    pages = fa.shape_bucket(meta.page_map.shape[0])
    gathered = fa.gather_pages(b.cache, meta.page_map, pages)
    k, v = fa.gathered_views(gathered, 128)
    kc, vc = k.contiguous(), v.contiguous()
    q = b.q.permute(1, 0, 2)[None]
    req, qpos, kv_limit, owner, logical = meta.tables[:5]
    ours_mask, _ = fa._mods(req, qpos, kv_limit, owner, logical, fa.GATHER_PAGE,
                            fa.GATHER_PAGE, True, None, None, None, None, None, gathered=True)
    fns = {
        "flex": lambda: impl.forward(b.q, b.cache, meta, b.out),
        "gather": lambda: fa.gather_pages(b.cache, meta.page_map, pages),
        "flex_gathered": lambda: fa._run_flex(b.q, gathered, meta.tables, b.out, None, None,
                                              None, impl.scale, None, None, True, impl.mods,
                                              gathered=True),
        "dense": flex_dense(b, True),
    }
    dense_run = fns["dense"]
    fns["ours_strided"] = direct(q, k, v, meta.tables, s, ours_mask, {})
    fns["ours_contig"] = direct(q, kc, vc, meta.tables, s, ours_mask, {})
    fns["causal_strided"] = direct(q, k, v, meta.tables, s, lambda b_, h, i, j: j <= i, {})
    fns["causal_contig"] = direct(q, kc, vc, meta.tables, s, lambda b_, h, i, j: j <= i, {})
    if first and os.environ.get("AB_FLEX_OPTIONS"):
        for name, opt in OPTIONS.items():
            fns[f"ours_strided_{name}"] = direct(q, k, v, meta.tables, s, ours_mask, opt)
    # the dense anchor's output without its copy
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    dk = b.cache[b.meta.block_table[:, :b.pages].long(), 0].reshape(1, -1, 8, 128)[:, :s] \
        .transpose(1, 2).contiguous()
    dv = b.cache[b.meta.block_table[:, :b.pages].long(), 1].reshape(1, -1, 8, 128)[:, :s] \
        .transpose(1, 2).contiguous()
    dmask = create_block_mask(lambda b_, h, i, j: i >= j, None, None, s, s, device="cuda")
    dfn = torch.compile(flex_attention, fullgraph=True)

    def dense_kernel():
        with torch._dynamo.config.patch(recompile_limit=256):
            return dfn(q, dk, dv, block_mask=dmask, enable_gqa=True)
    fns["dense_kernel"] = dense_kernel
    # correctness: every attention variant against the dense anchor
    dense_run()
    truth = b.out.float().clone()
    diffs, errors = {}, {}
    for name, fn in list(fns.items()):
        try:
            res = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (recorded, variant dropped)
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {name} failed: {errors[name]}", flush=True)
            del fns[name]
            continue
        if name == "gather":
            continue
        got = b.out if res is None else res[0].transpose(0, 1)
        diffs[name] = (got.float() - truth).abs().max().item()
    ms = time_graph(fns, 3)
    flops = prefill_flops(1, s)
    print(f"prefill 1x{s}: " + "  ".join(f"{n} {t * 1e3:.1f}us ({flops / t / 1e9:.0f})"
                                         for n, t in ms.items()), flush=True)
    bad = {n: d for n, d in diffs.items() if d > 0.02}
    if bad:
        print(f"  diffs over 0.02: {bad}", flush=True)
    if first:
        from torch.profiler import ProfilerActivity, profile
        for name in ("flex", "dense"):
            fns[name]()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fns[name]()
                torch.cuda.synchronize()
            print(f"--- profile {name} (1x{s}, 20 calls)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                            max_name_column_width=70))
    return dict(seq=s, ms=ms, diffs=diffs, errors=errors)


def main():
    gen = torch.Generator().manual_seed(0)
    rows = [point(s, gen, i == 0) for i, s in enumerate(POINTS)]
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(rows=rows), open(os.path.join(out, "exp_flex_short.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
