"""Experiment (not a benchmark of record): FLEX_ATTENTION's decode layout with FlexAttention's
split count (``SPLIT_KV``, by default ``2 * SMs // (batch * KV heads)``, at least 1) and
pipeline stages varied, next to compiled flex_attention on dense K/V and FlashInfer (H200,
page 16, bf16, 32/8 heads, d128), as CUDA-graph replays in one run.

Variants (``AB_FLEX_VARIANTS``, comma-separated): ``flex`` (as shipped), ``x<M>`` (the
default split count times ``M``), ``k<N>`` (``N`` splits), ``s<S>`` (``S`` stages), combined
as ``[n][x<M>|k<N>][s<S>]``; a leading ``n``: the decode layout without full KV blocks
(``DECODE_FULL_BLOCKS`` off; with them FlexAttention splits the whole cache's length, not each
request's pages, into ``SPLIT_KV`` chunks, so most splits of a request are empty). Points:
``AB_FLEX_DECODE=BxCTX,...``; ``AB_FLEX_DENSE=0``: no dense anchor. Prints one line per point,
writes ``$OUT/exp_flex_decode.json``.

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

from attn_ops.backends import flex_attention as fa  # noqa: E402

POINTS = [tuple(int(x) for x in p.split("x")) for p in
          os.environ.get("AB_FLEX_DECODE", "1x32768,8x8192,8x32768,64x8192").split(",")]
VARIANTS = os.environ.get("AB_FLEX_VARIANTS", "flex,x8,n,nx2,nx4,nx8").split(",")


def default_splits(batch: int) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(sms // (batch * HKV) * 2, 1)


def variant(b: Batch, name: str, batch: int):
    m = re.fullmatch(r"(n)?(?:x(\d+)|k(\d+))?(?:s(\d+))?", "" if name == "flex" else name)
    fn = built_with(b, "FLEX_ATTENTION", fa, "DECODE_FULL_BLOCKS", not m.group(1))
    options = {}
    if m.group(2):
        options["SPLIT_KV"] = default_splits(batch) * int(m.group(2))
    if m.group(3):
        options["SPLIT_KV"] = int(m.group(3))
    if m.group(4):
        options["num_stages"] = int(m.group(4))
    if options:
        fn = with_setting(fn, fa, "GPU_KERNEL_OPTIONS", options)
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
            fn = variant(b, name, bsz)
            try:
                fn()
                torch.cuda.synchronize()
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 (reported)
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {name} failed: {errors[name]}", flush=True)
        diffs = check_outputs(b, fns, "flashinfer")
        ms = time_graph(fns, 2)
        amount = decode_bytes(bsz, ctx)
        parts = [f"{k} {v * 1e3:.1f}us {amount / v / 1e9:.2f}TB/s" for k, v in ms.items()]
        ratios = [f"{k}/dense {ms['flex_dense'] / v:.2f}" for k, v in ms.items()
                  if k not in ("flashinfer", "flex_dense") and "flex_dense" in ms]
        print(f"decode {bsz}x{ctx} (default splits {default_splits(bsz)}): " + "  ".join(parts)
              + "  " + "  ".join(ratios) + f"  maxdiff {max(diffs.values()):.2g}", flush=True)
        rows.append(dict(batch=bsz, ctx=ctx, ms=ms, diffs=diffs, errors=errors,
                         default_splits=default_splits(bsz)))
        del b, fns
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(commit=os.environ.get("ATTN_OPS_COMMIT"), variants=VARIANTS, rows=rows),
              open(os.path.join(out, "exp_flex_decode.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
