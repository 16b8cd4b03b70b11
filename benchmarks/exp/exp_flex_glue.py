"""Experiment (not a benchmark of record): FLEX_ATTENTION's glue around FlexAttention's kernel
in a short causal prefill (H200, 1 request, page 16, bf16, 32/8 heads, d128), the op itself
with ``flex_attention._flex`` swapped, next to compiled flex on dense K/V, in one run:

* ``flex``              -- as shipped: rows copied into ``out`` inside the compiled graph, the
  block lists' width marked dynamic;
* ``copy_eager``        -- the graph returns FlexAttention's output, ``out.copy_`` outside it
  (a plain copy between contiguous tensors);
* ``static`` / ``copy_eager_static`` -- the same two without marking the width dynamic.

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_flex_glue.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import with_setting  # noqa: E402
from bench_gpu_attention import Batch, SPEC, prefill_flops, time_graph  # noqa: E402
from bench_triton_attention import flex_dense  # noqa: E402

from attn_ops import get_backend_class  # noqa: E402
from attn_ops.backends import flex_attention as fa  # noqa: E402


def compiled(copy_inside):
    """A compiled ``attend`` like ``fa._flex()``'s, with its own code object (own cache)."""
    from torch.nn.attention.flex_attention import flex_attention

    src = (
        "def attend(q, k, v, out, score_mod, block_mask, scale, enable_gqa, return_lse,\n"
        "           kernel_options, decode):\n"
        "    result = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,\n"
        "                            scale=scale, enable_gqa=enable_gqa,\n"
        "                            return_lse=return_lse, kernel_options=kernel_options)\n"
        "    o, lse = result if return_lse else (result, None)\n"
        "    o = o[:, :, 0] if decode else o[0].transpose(0, 1)\n"
        + ("    out.copy_(o[:out.shape[0]])\n    return lse\n" if copy_inside else
           "    return o[:out.shape[0]], lse\n"))
    scope = {"flex_attention": flex_attention}
    exec(compile(src, f"<attend_{copy_inside}>", "exec"), scope)
    fn = torch.compile(scope["attend"], fullgraph=True, dynamic=False)
    if copy_inside:
        return fn

    def attend(q, k, v, out, *rest):
        o, lse = fn(q, k, v, out, *rest)
        out.copy_(o)
        return lse
    return attend


def variant(run, attend, static):
    run = with_setting(run, fa, "_flex", lambda: attend)
    if static:
        run = with_setting(run, torch._dynamo, "maybe_mark_dynamic", lambda *a: None)
    return run


def main():
    gen = torch.Generator().manual_seed(0)
    rows = []
    for s in (1024, 8192):
        b = Batch(1, s, s, 16, gen)
        impl = get_backend_class("FLEX_ATTENTION")(SPEC)
        meta = impl.build_metadata(b.meta)
        base = lambda: impl.forward(b.q, b.cache, meta, b.out)  # noqa: E731
        fns = {"flex": base,
               "copy_eager": variant(base, compiled(False), False),
               "static": variant(base, compiled(True), True),
               "copy_eager_static": variant(base, compiled(False), True),
               "dense": flex_dense(b, True)}
        fns["dense"]()
        truth = b.out.float().clone()
        diffs = {}
        for name, fn in list(fns.items()):
            b.out.zero_()
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (reported, variant dropped)
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                del fns[name]
                continue
            diffs[name] = (b.out.float() - truth).abs().max().item()
        ms = time_graph(fns, 3)
        flops = prefill_flops(1, s)
        print(f"prefill 1x{s}: " + "  ".join(f"{n} {t * 1e3:.1f}us ({flops / t / 1e9:.0f})"
                                             for n, t in ms.items())
              + f"  max diff {max(diffs.values()):.3g}", flush=True)
        rows.append(dict(seq=s, ms=ms, diffs=diffs))
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(rows=rows), open(os.path.join(out, "exp_flex_glue.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
