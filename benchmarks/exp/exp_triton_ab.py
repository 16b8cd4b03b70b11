"""Experiment (not a benchmark of record): TRITON_ATTN kernel files side by side on the H200.

Each ``NAME=PATH`` argument is a version of ``triton_attn_kernels.py`` (the default: this
checkout's as ``head``; ``NAME=@PATCH``: this checkout's with one of ``PATCHES`` applied).
Every version is timed through the op at the same decode points (DECODE_TILES as given,
MANY_ITEMS_TILE off) and causal prefill points (several PREFILL_TILES, short steps' own
tiles off), next to FlashInfer, in one run. Points and tiles may be set in the environment
(``AB_DECODE=256x8192,...``, ``AB_PREFILL=`` for none, ``AB_DECODE_TILES=16/64/4/3,...``).
Prints one line per point, writes ``$OUT/exp_triton_ab.json``. ``--check [PATCH ...]`` runs
each patch against REFERENCE in Triton's interpreter instead (CPU).

    source .gpu/bootstrap.sh && python benchmarks/exp/exp_triton_ab.py \
        head=backends/triton_attn_kernels.py onephase=@onephase other=/path/to/kernels.py
"""
import json
import os
import sys

if sys.argv[1:2] == ["--check"]:  # (the interpreter must be chosen before kernels are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import with_prefill_tile, with_setting  # noqa: E402
from bench_gpu_attention import (Batch, decode_bytes, flashinfer_direct, ours,  # noqa: E402
                                 prefill_flops, time_graph)
from exp_triton_prefill import load_file, load_patched, with_module  # noqa: E402
from patch_overlap import PATCH as PATCH_OVERLAP  # noqa: E402

import attn_ops.backends.triton_attn as ta  # noqa: E402
import attn_ops.backends.triton_attn_kernels  # noqa: E402,F401 (swapped per version)


def _env(name, default):
    """``BxN,BxN`` (points) or ``R/N/W/S,...`` (tiles) from the environment, else ``default``."""
    text = os.environ.get(name)
    if text is None:
        return default
    sep = "/" if "TILES" in name else "x"
    return [tuple(int(x) for x in item.split(sep)) for item in text.split(",") if item]


DECODE = _env("AB_DECODE", [(1, 32768), (4, 32768), (64, 32768), (8, 1024), (64, 1024),
                            (256, 8192)])
DECODE_TILES = _env("AB_DECODE_TILES", [(16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2)])
PREFILL = _env("AB_PREFILL", [(1, 1024), (16, 1024), (4, 4096), (1, 8192)])
PREFILL_TILES = _env("AB_PREFILL_TILES", [(128, 128, 8, 3), (128, 64, 8, 3)])


# Source patches of this checkout's kernel file, named ``@NAME`` on the command line:
# ``onephase``: every key block in one masked loop (no separate loops for the whole blocks and
# the masked edges: each loop has its own pipeline prologue, which short key ranges -- short
# prefills, decodes of short contexts -- may not amortize).
DIAG_FIRST = [("        elif phase == 1:\n            b0, b1 = first_full, end_full\n",
               "        elif phase == 2:\n            b0, b1 = first_full, end_full\n"),
              ("HAS_ALIBI, HAS_TREE, PRECISION, phase != 1)",
               "HAS_ALIBI, HAS_TREE, PRECISION, phase != 2)")]
PATCHES = {
    "onephase": [("    first_full = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N), "
                  "num_blocks)\n", "    first_full = num_blocks\n")],
    # ``ws``: Triton's automatic warp specialization on every key-block loop (on Hopper it is
    # documented for TMA loads; ours are gathered through the block table -- does it apply?).
    "ws": [("    for b in range(b0, b1):\n",
            "    for b in tl.range(b0, b1, warp_specialize=True):\n")],
    # ``overlap``: whole key blocks issue the next block's Q K^T before this block's softmax
    # (patch_overlap.py).
    "overlap": PATCH_OVERLAP,
    # ``diagfirst``: the masked diagonal / tail blocks before the whole ones, so their loads
    # start beside the query's instead of after the whole blocks' pipeline drains.
    "diagfirst": DIAG_FIRST,
    "overlap_diagfirst": PATCH_OVERLAP + DIAG_FIRST,
    # (``lpt``, the KV head fastest in launch order, won in run 6 and is the kernel's
    # HEADS_FASTEST now.)
}


def check(names):
    """Each patch against REFERENCE in Triton's interpreter (CPU; fp32 and fp16): decodes and
    causal prefills over 16-key blocks, several whole ones per tile. A patch is timed on the
    H200 only after this passes."""
    from attn_ops import AttentionSpec, get_backend_class
    from attn_ops.testing import Scenario, assert_matches_reference, make_case, run_backend

    triton_attn = get_backend_class("TRITON_ATTN")
    scenario = Scenario(((7, 1), (0, 150), (40, 90), (100, 33)))
    for name in names:
        mod = load(name, "@" + name)
        for dtype in (torch.float32, torch.float16):
            spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype)
            case = make_case(spec, scenario, block_size=16, seed=3)
            run = with_prefill_tile(lambda: run_backend(triton_attn, case), (32, 16, 4, 2))
            if dtype == torch.float32:
                run = with_setting(run, ta.PREFILL_TILES, (True, 4), (32, 16, 4, 2))
            out, _ = with_module(run, mod)()
            assert_matches_reference(out, case)
            print(f"{name} matches REFERENCE ({dtype})", flush=True)


def load(name, path):
    """Version ``name``: the kernel file at ``path``, or this checkout's patched (``@PATCH``)."""
    if path.startswith("@"):
        head = os.path.join(os.path.dirname(os.path.abspath(ta.__file__)), "triton_attn_kernels.py")
        return load_patched(name, open(head).read(), PATCHES[path[1:]])
    return load_file(name, path)


def main():
    if sys.argv[1:2] == ["--check"]:
        return check(sys.argv[2:] or [n for n in PATCHES if n != "ws"])
    here = os.path.dirname(os.path.abspath(ta.__file__))
    versions = dict(a.split("=", 1) for a in sys.argv[1:]) or \
        {"head": os.path.join(here, "triton_attn_kernels.py")}
    mods = {n: load(n, p) for n, p in versions.items()}
    gen = torch.Generator().manual_seed(0)
    rows = []
    points = [("decode", b, c) for b, c in DECODE] + [("prefill", b, s) for b, s in PREFILL]
    for kind, bsz, n in points:
        prefill = kind == "prefill"
        b = Batch(bsz, n, n if prefill else 1, 16, gen)
        fns = {"flashinfer": flashinfer_direct(b, prefill)}
        fns["flashinfer"]()
        truth = b.out.float().clone()
        diffs = {}
        tiles = PREFILL_TILES if prefill else DECODE_TILES
        for name, mod in mods.items():
            for tile in tiles:
                key = f"{name}_{'x'.join(map(str, tile))}"
                fn = with_prefill_tile(ours(b, "TRITON_ATTN"), tile) if prefill else \
                    with_setting(with_setting(ours(b, "TRITON_ATTN"), ta.DECODE_TILES, True,
                                              tile), ta, "MANY_ITEMS_TILE", None)
                fn = with_module(fn, mod)
                b.out.zero_()
                try:
                    fn()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (a version that fails is reported)
                    print(f"  {key} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                diffs[key] = (b.out.float() - truth).abs().max().item()
                fns[key] = fn
        ms = time_graph(fns, 2)
        amount, unit = (prefill_flops(bsz, n), "TFLOP/s") if prefill else \
            (decode_bytes(bsz, n), "TB/s")
        parts = [f"{k} {amount / v / 1e9:.3g}" for k, v in ms.items()]  # amount/ms/1e9
        print(f"{kind} {bsz}x{n} ({unit}): " + "  ".join(parts), flush=True)
        worst = max(diffs.values())
        if worst > 0.02:
            print(f"  max diff {worst:.4f}: {diffs}", flush=True)
        rows.append(dict(kind=kind, batch=bsz, n=n, unit=unit, ms=ms, diffs=diffs))
        del b, fns
    out = os.environ.get("OUT", "/tmp")
    json.dump(dict(versions=versions, rows=rows), open(os.path.join(out, "exp_triton_ab.json"),
                                                         "w"), indent=1)


if __name__ == "__main__":
    main()
