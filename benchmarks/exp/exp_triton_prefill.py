"""Experiment (not a benchmark of record): where TRITON_ATTN's prefill time goes on the H200.

Variants of ``triton_attn_kernels.py`` made by patching its source text, timed through the op
next to FlashInfer at causal 1x8k / 4x4k (page 16 unless named), several tiles each, and
smaller tiles for the short prefills 1x1k / 16x1k (``base`` only):
``base`` (whole blocks' page numbers loaded one block ahead); ``inline`` (loaded in the block's
own iteration, as before); ``nolookup`` (whole blocks read pages 0.. without the block table:
wrong output, isolates the lookup's cost).

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_triton_prefill.py  (on the H200)
"""
import importlib.util
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _common import with_prefill_tile  # noqa: E402
from bench_gpu_attention import Batch, flashinfer_direct, ours, prefill_flops, time_graph  # noqa

import attn_ops.backends.triton_attn as ta  # noqa: E402
import attn_ops.backends.triton_attn_kernels  # noqa: E402,F401 (swapped per variant)

SRC = open(os.path.join(os.path.dirname(ta.__file__), "triton_attn_kernels.py")).read()
WHOLE = ("            page = next_page\n            next_page = tl.load(bt_row + (offs_n + BLOCK_N)"
         " // PAGE,\n                                mask=(offs_n * 0 + b + 1) < b1, other=0)\n")
PATCHES = {
    "base": [],
    "inline": [(WHOLE, "            page = tl.load(bt_row + offs_n // PAGE)\n")],
    "nolookup": [(WHOLE, "            page = offs_n // PAGE\n")],
}
TILES = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3)]
# Short prefills (1x1k: 256 programs of 128-row tiles for 132 SMs): smaller tiles, base only.
SHORT_TILES = [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 3),
               (64, 64, 8, 3)]


def load_variant(name):
    return load_patched(name, SRC, PATCHES[name])


def load_patched(name, src, patches):
    """The kernel module ``src`` with each ``(old, new)`` of ``patches`` replaced once, loaded
    as ``tak_<name>`` (not ``attn_ops``'s: :func:`with_module` swaps it in)."""
    for a, b in patches:
        assert a in src, (name, a)
        src = src.replace(a, b)
    path = os.path.join(tempfile.mkdtemp(), f"tak_{name}.py")
    open(path, "w").write(src)
    return load_file(name, path)


def load_file(name, path):
    spec = importlib.util.spec_from_file_location(f"tak_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def with_module(fn, mod):
    key = "attn_ops.backends.triton_attn_kernels"

    def run():
        old = sys.modules[key]
        sys.modules[key] = mod
        try:
            return fn()
        finally:
            sys.modules[key] = old
    return run


def main():
    gen = torch.Generator().manual_seed(0)
    mods = {n: load_variant(n) for n in PATCHES}
    rows = []
    for bsz, s, page in ((1, 8192, 16), (4, 4096, 16), (1, 8192, 128), (1, 1024, 16),
                         (16, 1024, 16)):
        b = Batch(bsz, s, s, page, gen)
        fns = {"flashinfer": flashinfer_direct(b, True)}
        fns["flashinfer"]()
        truth = b.out.float().clone()
        diffs = {}
        for name, mod in mods.items():
            short = s <= 1024
            if (page != 16 or short) and name != "base":
                continue
            for tile in SHORT_TILES if short else TILES:
                key = f"{name}_{'x'.join(map(str, tile))}"
                fn = with_module(with_prefill_tile(ours(b, "TRITON_ATTN"), tile), mod)
                try:
                    b.out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    diffs[key] = (b.out.float() - truth).abs().max().item()
                    fns[key] = fn
                except Exception as e:  # noqa: BLE001
                    print(key, "failed:", type(e).__name__, str(e)[:200], flush=True)
        ms = time_graph(fns, 1)
        flops = prefill_flops(bsz, s)
        print(f"\n{bsz}x{s} page {page}: flashinfer {flops / ms['flashinfer'] / 1e9:.0f} TFLOP/s")
        for k, v in ms.items():
            print(f"  {k:28s} {flops / v / 1e9:6.0f} TFLOP/s {ms['flashinfer'] / v:5.2f}x "
                  f"diff {diffs.get(k, 0):.4f}", flush=True)
        rows.append(dict(batch=bsz, seq=s, page=page, ms=ms, diffs=diffs))
        del b, fns
    out = os.environ.get("OUT", "/tmp")
    json.dump(rows, open(os.path.join(out, "exp_triton_prefill.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
