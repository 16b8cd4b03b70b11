"""Experiment (not a benchmark of record): FLEX_ATTENTION's decode layout with its split rule
varied (``flex_attention.DECODE_PROGRAMS_PER_SM``: splits of each request's pages so that about
that many programs per SM run, no full KV blocks), next to compiled flex_attention on dense K/V
and FlashInfer (H200, page 16, bf16, 32/8 heads, d128), as CUDA-graph replays in one run.

Variants (``AB_FLEX_VARIANTS``, comma-separated): ``flex`` (as shipped), ``p<N>`` (``N``
programs per SM), ``full`` (the rule off: full KV blocks, FlexAttention's own split count --
``2 x SMs // (batch x KV heads)`` chunks of the whole cache's length), each with an optional
``s<S>`` (``S`` pipeline stages). Points: ``AB_FLEX_DECODE=BxCTX,...``; ``AB_FLEX_DENSE=0``:
no dense anchor. Prints one line per point, writes ``$OUT/exp_flex_decode.json``. (Runs 1-3,
at 2065f38, varied ``SPLIT_KV`` over the whole cache with the full lists left empty but
present -- which FlexAttention still treats as full blocks.)

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_flex_decode.py
"""
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import with_setting  # noqa: E402
from bench_gpu_attention import (HKV, Batch, check_outputs, decode_bytes,  # noqa: E402
                                 flashinfer_direct, time_graph)
from bench_triton_attention import built_with, flex_dense  # noqa: E402
from sweep_kernel_configs import try_variant  # noqa: E402

from attn_ops.backends import flex_attention as fa  # noqa: E402
from attn_ops.backends.flex_attention import decode_batch  # noqa: E402

POINTS = [tuple(int(x) for x in p.split("x")) for p in os.environ.get(
    "AB_FLEX_DECODE", "1x8192,1x32768,4x32768,8x8192,16x32768,32x8192,64x8192").split(",")]
VARIANTS = os.environ.get("AB_FLEX_VARIANTS", "flex,p2,p8,full").split(",")


def variant(b: Batch, name: str):
    m = re.fullmatch(r"(flex|full|p(\d+))(?:s(\d+))?", name)
    per_sm = fa.DECODE_PROGRAMS_PER_SM if m.group(1) == "flex" else \
        None if m.group(1) == "full" else int(m.group(2))
    fn = with_setting(built_with(b, "FLEX_ATTENTION", fa, "DECODE_PROGRAMS_PER_SM", per_sm), fa,
                      "DECODE_PROGRAMS_PER_SM", per_sm)
    if m.group(3):
        fn = with_setting(fn, fa, "GPU_KERNEL_OPTIONS", {"num_stages": int(m.group(3))})
    return fn


def main():
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bsz, ctx in POINTS:
        b = Batch(bsz, ctx, 1, 16, gen)
        fns = {"flashinfer": flashinfer_direct(b, False)}
        if os.environ.get("AB_FLEX_DENSE", "1") == "1":
            fns["flex_dense"] = flex_dense(b, False)
        errors = {}
        for name in VARIANTS:
            try_variant(fns, errors, name, variant(b, name))
            if name in errors:
                print(f"  {name} failed: {errors[name]}", flush=True)
        diffs = check_outputs(b, fns, "flashinfer")
        splits = fa.decode_splits(decode_batch(bsz), HKV, b.q.device)
        ms = time_graph(fns, 2)
        amount = decode_bytes(bsz, ctx)
        parts = [f"{k} {v * 1e3:.1f}us {amount / v / 1e9:.2f}TB/s" for k, v in ms.items()]
        ratios = [f"{k}/dense {ms['flex_dense'] / v:.2f}" for k, v in ms.items()
                  if k not in ("flashinfer", "flex_dense") and "flex_dense" in ms]
        print(f"decode {bsz}x{ctx} (splits {splits}): " + "  ".join(parts)
              + "  " + "  ".join(ratios) + f"  maxdiff {max(diffs.values()):.2g}", flush=True)
        rows.append(dict(batch=bsz, ctx=ctx, ms=ms, diffs=diffs, errors=errors, splits=splits))
        del b, fns
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(commit=os.environ.get("ATTN_OPS_COMMIT"), variants=VARIANTS, rows=rows),
              open(os.path.join(out, "exp_flex_decode.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
