"""Kernel configurations the backends could choose, measured side by side (H200), to set
their rules from data rather than from defaults.

* ``decode``: FlashInfer's tensor-core decode (its FA2 prefill kernel, one query row per
  request) with the split-KV chunk left to FlashInfer's plan (``auto``), split-KV off
  (``nosplit``), or a fixed chunk of ``c`` pages (``fixed<c>``), next to FA4 (no split; its own
  tile, other tiles, heads unpacked) and our COMPOSITE_SM90 op (``ours_flash_attn``), over
  batch 1-256 x ctx 1k-32k at page 128 (the decode grid's points; ``--batches``,
  ``--ctxs``).
* ``triton-prefill``: TRITON_ATTN's 16-bit prefill tile (query rows, keys per tile, warps,
  stages: ``Tuning.triton.prefill_tile_16bit``, the short steps' own tile off) over causal
  prefills at page 16, next to FlashInfer called directly (the prefill goal: >= 0.8x
  FlashInfer).
* ``prefill``: FA4 over the paged cache and over dense K/V (the step's own keys: a prefill
  without cached context needs no page table), with its default sm90 tiles and alternatives
  (``tile_mn``, RS / overlap flags; the 192-row ones take three MMA warpgroups); FA4 in batch
  mode (``q [B, S, H, D]``, no ``cu_seqlens_q``: sm90 then schedules with
  ``SingleTileLPTScheduler`` instead of the varlen scheduler -- possible for a prefill part
  whose requests share one query length), also with the 192-row tile, and with
  the query heads of a KV head packed (``pack_gqa``); torch SDPA (cuDNN and flash) on dense
  tensors; our COMPOSITE_SM90 op with its own rules (``ours_flash_attn``; ``_batch``: with
  FA4's batch mode on from 256 rows, ``flash_attn.batch_mode_min_query=256``).
  ``--variants REGEX`` keeps only the matching variants, ``--prefill BxS ...`` sets the
  points.

Every variant's output is cross-checked against the reference's before timing
(``cross_check``, ``bench_gpu_attention.TOLERANCE``); a variant that disagrees is listed in
``mismatch`` and takes no part in "best" or a ratio; a variant that fails to build is recorded
with its error. Libraries are called by keyword. Timing: ``do_bench_cudagraph``
medians, variants of a point interleaved over rotating rounds (``time_graph``).

    python benchmarks/sweep_kernel_configs.py [--only decode|prefill|triton-prefill] [--rounds R]
        [--variants REGEX] [--prefill BxS ...] [--batches B ...] [--ctxs C ...] [--out PATH]
"""

from __future__ import annotations

import os
import re
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import checked_ratio, ratio_text  # noqa: E402
from bench_gpu_attention import (D, DTYPE, HKV, HQ, Batch, check_outputs,  # noqa: E402
                                 decode_bytes, fa4_direct, flashinfer_direct, gpu_parser,
                                 mismatches, ours, prefill_flops, time_graph, timed_fields,
                                 tuned, write_result)

DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CTX = (1024, 2048, 4096, 8192, 16384, 32768)
FIXED_CHUNKS = (1, 2, 4, 8, 16, 32)  # pages of 128 tokens
PREFILL = ((1, 8192), (4, 4096), (16, 1024), (1, 16384))
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); None = FA4's own choice for sm90.
# 192-row tiles take three MMA warpgroups (160 registers a thread): FA4 uses them up to head
# dim 96 only, without RS; at head dim 128 they may not fit (then recorded as not built).
FA4_TILES = (None, (128, 128, False, True), (128, 176, True, True), (128, 160, True, True),
             (128, 112, True, True), (128, 192, True, True), (128, 128, True, False),
             (192, 128, False, True), (192, 112, False, True), (192, 144, False, True),
             (192, 160, False, True), (192, 96, False, True), (192, 128, False, False))
TALL = (192, 128, False, True)  # FA4's sm90 prefill tile (Tuning.flash_attn.tall_tile)
# FA4 decode tiles (one query row, the GQA group's heads packed into the tile's rows).
DECODE_FA4_TILES = ((128, 176, True, True), (128, 112, True, True), (128, 192, True, True),
                    (64, 128, True, True), (64, 128, False, True), (64, 192, True, True),
                    (64, 96, True, True), (64, 112, True, True), (64, 160, True, True))


def flashinfer_tc(b: Batch, fixed: int = -1, nosplit: bool = False):
    """The tensor-core decode, planned by FlashInfer with the given split rule."""
    import flashinfer

    from attn_ops.backends.flashinfer_plan import paged_kv_csr

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    indptr, indices, last = (t.cuda() for t in paged_kv_csr(b.meta.seq_lens_cpu,
                                                            b.meta.block_table_cpu, b.page))
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer=ws,
                                                       kv_layout="NHD", backend="fa2")
    w.plan(qo_indptr=b.meta.query_start_loc, paged_kv_indptr=indptr, paged_kv_indices=indices,
           paged_kv_last_page_len=last, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
           page_size=b.page, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE,
           fixed_split_size=fixed, disable_split_kv=nosplit)
    return lambda: w.run(q=b.q, paged_kv_cache=b.cache, out=b.out)


def try_variant(fns: dict, errors: dict, name: str, fn) -> None:
    """Run ``fn`` once: it joins ``fns`` if it runs, else its error goes into ``errors`` (a
    configuration the kernel cannot build)."""
    try:
        fn()
        torch.cuda.synchronize()
        fns[name] = fn
    except Exception as e:  # noqa: BLE001 (recorded)
        errors[name] = f"{type(e).__name__}: {str(e)[:200]}"


def timed_row(b: Batch, fns: dict, reference: str, rounds: int, amount: float, unit: str,
              **fields) -> tuple[dict, dict[str, float]]:
    """One point: outputs cross-checked against ``reference``'s, then timed; the result row
    (with ``fields``) and the milliseconds of the variants that agreed with the reference --
    one that disagreed computes something else, so it can be neither "best" nor in a ratio
    (its time stays in the row, beside its errors)."""
    checks = check_outputs(b, fns, reference)
    ms = time_graph(fns, rounds)
    bad = mismatches(checks)
    if bad:
        print(f"  MISMATCH (left out of best and ratios): {bad}", flush=True)
    return ({**fields, "cross_check": checks, "mismatch": bad, **timed_fields(ms, amount, unit)},
            {k: v for k, v in ms.items() if k not in bad})


def sweep_decode(args, gen) -> list[dict]:
    rows = []
    for bsz in args.batches or DECODE_BATCH:
        for ctx in args.ctxs or DECODE_CTX:
            b = Batch(bsz, ctx, 1, 128, gen)
            fns = {"auto": flashinfer_tc(b), "nosplit": flashinfer_tc(b, nosplit=True)}
            errors = {}
            for c in FIXED_CHUNKS:
                if c < b.pages:
                    try:
                        fns[f"fixed{c}"] = flashinfer_tc(b, fixed=c)
                    except RuntimeError as e:  # too many chunks for the workspace
                        errors[f"fixed{c}"] = str(e)[:200]
            fns["fa4"] = fa4_direct(b)
            kc, vc = b.cache.unbind(1)
            m = b.meta
            paged = dict(cu_seqlens_q=m.query_start_loc, seqused_k=m.seq_lens, max_seqlen_q=1,
                         max_seqlen_k=ctx, page_table=m.block_table)
            variants = {"ours_flash_attn": partial(ours, b, "COMPOSITE_SM90"),
                        "fa4_nopack": partial(fa4_variant, b.q, kc, vc, None, pack_gqa=False,
                                              **paged)}
            for tile in DECODE_FA4_TILES:
                variants["fa4_" + tile_name(tile)] = partial(fa4_variant, b.q, kc, vc, tile,
                                                             **paged)
            fns = {k: f for k, f in fns.items() if k == "auto" or re.search(args.variants, k)}
            for name, make in variants.items():
                if re.search(args.variants, name):
                    try_variant(fns, errors, name, make())
            nbytes = decode_bytes(bsz, ctx)
            row, ms = timed_row(b, fns, "auto", args.rounds, nbytes, "tbs", kind="decode",
                                batch=bsz, ctx=ctx, errors=errors)
            best = min(ms, key=ms.get)
            print(f"decode B={bsz:<4} ctx={ctx:<6} best {best:8s} {nbytes / ms[best] / 1e9:.2f}"
                  "  " + " ".join(f"{k} {nbytes / v / 1e9:.2f}" for k, v in ms.items()),
                  flush=True)
            rows.append(row)
            del b, fns
    return rows


def fa4_variant(q, k, v, tile, **kw):
    from flash_attn.cute.interface import _flash_attn_fwd

    extra = {} if tile is None else dict(tile_mn=tile[:2], mma_pv_is_rs=tile[2],
                                         intra_wg_overlap=tile[3])
    return lambda: _flash_attn_fwd(q=q, k=k, v=v, causal=True, **kw, **extra)[0]


def tile_name(tile) -> str:
    return "x".join(map(str, tile[:2])) + ("" if tile[2] else "-noRS") + \
        ("" if tile[3] else "-noOL")


def batch_variant(q4, k, v, tile, kw, out_rows):
    run = fa4_variant(q4, k, v, tile, **kw)
    return lambda: run().reshape(out_rows, HQ, D)


def ours_batch_mode(b: Batch):
    """Our COMPOSITE_SM90 op with FA4's batch mode on for uniform prefill parts of at least
    256 rows (``flash_attn.batch_mode_min_query``)."""
    return ours(b, "COMPOSITE_SM90", tuning=tuned(flash_attn={"batch_mode_min_query": 256}))


def sweep_prefill(args, gen) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    points = [tuple(map(int, p.split("x"))) for p in args.prefill] if args.prefill else PREFILL
    for bsz, s in points:
        b = Batch(bsz, s, s, 128, gen)
        m = b.meta
        kc, vc = b.cache.unbind(1)
        # Dense K/V of the step in token order (what the layer wrote into the cache).
        slots = m.slot_mapping.long()
        flat = b.cache.permute(1, 0, 2, 3, 4).reshape(2, -1, HKV, D)
        k, v = flat[0][slots].contiguous(), flat[1][slots].contiguous()
        paged = dict(cu_seqlens_q=m.query_start_loc, seqused_k=m.seq_lens,
                     max_seqlen_q=s, max_seqlen_k=s, page_table=m.block_table)
        dense = dict(cu_seqlens_q=m.query_start_loc, cu_seqlens_k=m.query_start_loc,
                     max_seqlen_q=s, max_seqlen_k=s)
        variants = {}  # name -> maker of the fn, called only if the name passes --variants
        for tile in FA4_TILES:
            name = "default" if tile is None else tile_name(tile)
            for where, kv, kw in (("paged", (kc, vc), paged), ("dense", (k, v), dense)):
                variants[f"fa4_{where}_{name}"] = partial(fa4_variant, b.q, *kv, tile, **kw)
        for where, kv, kw in (("paged", (kc, vc), paged), ("dense", (k, v), dense)):
            variants[f"fa4_{where}_packgqa"] = partial(fa4_variant, b.q, *kv, None,
                                                       pack_gqa=True, **kw)
        # batch mode: the same tensors as [B, S, ...] views, lengths implied by the shapes
        q4, out_rows = b.q.view(bsz, s, HQ, D), bsz * s
        batch_kw = {"paged": dict(seqused_k=m.seq_lens, page_table=m.block_table), "dense": {}}
        for where, kv in (("paged", (kc, vc)), ("dense", (k.view(bsz, s, HKV, D),
                                                          v.view(bsz, s, HKV, D)))):
            for tile in (None, TALL):
                variants[f"fa4_{where}_batch" + ("" if tile is None else "_" + tile_name(tile))] \
                    = partial(batch_variant, q4, *kv, tile, batch_kw[where], out_rows)
        variants["ours_flash_attn"] = partial(ours, b, "COMPOSITE_SM90")  # the op, its rules
        variants["ours_flash_attn_batch"] = partial(ours_batch_mode, b)
        fns, errors = {}, {}
        for name, make in variants.items():
            if name == "fa4_paged_default" or re.search(args.variants, name):
                try_variant(fns, errors, name, make())
        qd = b.q.view(bsz, s, HQ, D).transpose(1, 2)
        kd = k.view(bsz, s, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
        vd = v.view(bsz, s, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1)
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(query=qd, key=kd, value=vd,
                                                          is_causal=True) \
                        .transpose(1, 2).reshape(bsz * s, HQ, D)
            if re.search(args.variants, name):
                try_variant(fns, errors, name, sdpa)
        flops = prefill_flops(bsz, s)
        row, ms = timed_row(b, fns, "fa4_paged_default", args.rounds, flops, "tflops",
                            kind="prefill", batch=bsz, seq=s, errors=errors)
        best = min(ms, key=ms.get)
        print(f"prefill {bsz}x{s:<6} best {best} {flops / ms[best] / 1e9:.0f}  " + " ".join(
            f"{k} {flops / v / 1e9:.0f}" for k, v in ms.items()) + " TFLOP/s", flush=True)
        if errors:
            print("  not built:", errors, flush=True)
        rows.append(row)
        del b, fns
    return rows


TRITON_PREFILL = ((1, 8192), (4, 4096), (16, 1024))
TRITON_TILES = ((128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 32, 8, 3),
                (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
                (64, 32, 4, 4), (64, 128, 4, 3))


def triton_tile(b: Batch, tile):
    """TRITON_ATTN through its op with ``tile`` as its 16-bit prefill tile, for short steps
    too (their own tile off)."""
    from attn_ops.tuning import Tile

    return ours(b, "TRITON_ATTN", tuning=tuned(triton={"prefill_tile_16bit": Tile(*tile),
                                                       "short_prefill_tile_16bit": None}))


def sweep_triton_prefill(args, gen) -> list[dict]:
    rows = []
    for bsz, s in TRITON_PREFILL:
        b = Batch(bsz, s, s, args.page, gen)
        fns, errors = {"flashinfer": flashinfer_direct(b, True)}, {}
        for tile in TRITON_TILES:  # (a tile may not build: out of shared memory, say)
            try_variant(fns, errors, "triton_" + "x".join(map(str, tile)), triton_tile(b, tile))
        flops = prefill_flops(bsz, s)
        row, ms = timed_row(b, fns, "flashinfer", args.rounds, flops, "tflops",
                            kind="triton_prefill", batch=bsz, seq=s, page=args.page,
                            errors=errors)
        rows.append(row)
        # (ms holds only the tiles whose output agreed with FlashInfer's: ratios are guarded)
        ratios = {k: checked_ratio(ms[k], ms["flashinfer"], row["cross_check"][k])
                  for k in row["cross_check"] if k != "flashinfer"}
        row["flashinfer_over_tile"] = ratios
        best = min((k for k in ms if k != "flashinfer"), key=ms.get, default=None)
        print(f"triton prefill {bsz}x{s:<6} best {best} "
              f"{ratio_text(ratios.get(best))} flashinfer "
              f"({flops / ms['flashinfer'] / 1e9:.0f} TFLOP/s)  " + " ".join(
                  f"{k[7:]} {ratio_text(r)}" for k, r in ratios.items()), flush=True)
        if errors:
            print("  not built:", errors, flush=True)
        del b, fns
    return rows


def main() -> None:
    parser = gpu_parser(__doc__, "sweep_kernel_configs_h200.json", page=128, rounds=2,
                        quick=False)
    parser.add_argument("--only", choices=("decode", "prefill", "triton-prefill"))
    parser.add_argument("--batches", type=int, nargs="*", help="decode batch sizes")
    parser.add_argument("--ctxs", type=int, nargs="*", help="decode context lengths")
    parser.add_argument("--variants", default="", help="only the variants whose name "
                        "matches this regex (and the reference: fa4_paged_default for prefill, "
                        "auto for decode)")
    parser.add_argument("--prefill", nargs="*", default=None, help="prefill points BxS")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    if args.only in (None, "prefill"):
        rows += sweep_prefill(args, gen)
    if args.only in (None, "decode"):
        rows += sweep_decode(args, gen)
    if args.only == "triton-prefill":
        rows += sweep_triton_prefill(args, gen)
    write_result("sweep_kernel_configs", args.out, rounds=args.rounds, rows=rows,
                 method="median over rotating rounds of triton.testing.do_bench_cudagraph "
                        "medians (rep=30 ms)")


if __name__ == "__main__":
    main()
