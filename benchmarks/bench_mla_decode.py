"""MLA decode: TRITON_MLA's absorbed kernel against FlashInfer's MLA kernels called directly,
side by side in one run (H200).

The same latent rows (bf16, DeepSeek dims: ``kv_lora_rank`` 512 + rope 64, page 64, pages in
random order), one query token per request, ``heads`` query heads:

* ``triton_mla``   -- TRITON_MLA's absorbed launch (kernel + split combine) on ``ql`` / ``q_pe``,
  launch from ``routing.mla_decode_launch`` for this batch;
* ``triton_mla_op`` / ``flashinfer_mla_op`` -- the whole TRITON_MLA / FLASHINFER_MLA op of a
  step (``q_nope @ W_UK``, the kernel, ``@ W_UV``), for what the layer adds;
* ``flashinfer_fa3`` / ``flashinfer_fa2`` -- ``flashinfer.mla.BatchMLAPagedAttentionWrapper``
  with ``backend="fa3"`` / ``"fa2"``, planned before timing, on contiguous ``ckv`` / ``kpe``
  caches holding the same rows (the anchors).

The kernels' outputs are cross-checked against TRITON_MLA's first (``cross_check_vs_triton_mla``,
``bench_gpu_attention.TOLERANCE``): one that disagrees is printed ``name(MISMATCH)`` with its
errors and listed in the row's ``mismatch``. FlashInfer is called by keyword. Each contender
is timed as CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), contenders
interleaved over ``--rounds`` rounds, and eagerly (calls back to back, ``eager_us``). FLOPs =
B * H * ctx * 2 * (576 + 512) -> TFLOP/s; bytes = B * ctx * 576 * 2 -> TB/s; both are
reported.

    python benchmarks/bench_mla_decode.py [--heads 16 128] [--batches ...] [--ctxs ...]
        [--tiles 32x64x4x2 ...] [--no-ops] [--rounds R] [--out PATH]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import check_text, cross_check, eager_ms  # noqa: E402
from bench_gpu_attention import TOLERANCE, gpu_parser, time_graph, write_result  # noqa: E402

RANK, ROPE, NOPE, V = 512, 64, 128, 128
DTYPE = torch.bfloat16


class MLABatch:
    """``batch`` decodes of ``ctx`` tokens over a random latent cache in random page order."""

    def __init__(self, heads, batch, ctx, page, gen):
        self.heads, self.batch, self.ctx, self.page = heads, batch, ctx, page
        pages = -(-ctx // page)
        num_blocks = batch * pages + 1
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_table = perm[:batch * pages].view(batch, pages).cuda()
        self.cache = torch.randn(num_blocks, page, RANK + ROPE, dtype=DTYPE, device="cuda")
        self.ql = torch.randn(batch, heads, RANK, dtype=DTYPE, device="cuda")
        self.q_pe = torch.randn(batch, heads, ROPE, dtype=DTYPE, device="cuda")
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.scale = (NOPE + ROPE) ** -0.5
        self.out = torch.empty(batch, heads, RANK, dtype=DTYPE, device="cuda")


def triton_mla(b: MLABatch, tile: str | None = None):
    """TRITON_MLA's absorbed launch on ``b``: this machine's tuning, or with ``tile``
    (``ROWSxKEYSxWARPSxSTAGES``, optionally ``xMAX_SPLITSxMIN_KEYS_PER_SPLIT[xVALUE_PARTS]``)
    replacing its decode tile (and split bounds, value parts; the split rule follows them)."""
    from attn_ops import AttentionSpec
    from attn_ops.backends.mla.triton_mla import absorbed_triton, triton_mla_launch
    from attn_ops.tuning import default_tuning

    t = default_tuning().mla
    if tile is not None:  # (its warps and stages for wide and narrow programs alike)
        rows, keys, warps, stages, *bounds = (int(x) for x in tile.split("x"))
        t = default_tuning().with_(mla={
            "decode_rows": rows, "decode_keys": keys, "decode_warps": warps,
            "decode_stages": stages, "narrow_warps": warps, "narrow_stages": stages,
            **dict(zip(("max_splits", "min_keys_per_split", "value_parts"), bounds))}).mla
    spec = AttentionSpec.mla(b.heads, dtype=DTYPE, block_size=b.page)
    launch = triton_mla_launch(spec, b.batch, 1, b.ctx, b.cache.device, t)
    return lambda: absorbed_triton(b.ql, b.q_pe, b.cache, b.qsl, b.seq_lens, b.block_table,
                                   b.out, None, b.scale, launch)


def kernel_facts(kernel) -> str:
    """``regs/spills/shared KiB/mma kind`` of a compiled Triton kernel."""
    if kernel is None or not hasattr(kernel, "asm"):
        return "?"
    ptx = kernel.asm.get("ptx", "")
    mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "none"
    shared = getattr(kernel.metadata, "shared", 0) or 0
    return (f"{getattr(kernel, 'n_regs', '?')}r/{getattr(kernel, 'n_spills', '?')}s/"
            f"{shared >> 10}K/{mma}")


def mla_op(b: MLABatch, backend: str):
    """``backend``'s whole op on a decode step of ``b`` (random W_UK / W_UV, q of width
    nope + rope), metadata (and any plan) built before timing."""
    from attn_ops import AttentionConfig, AttentionSpec, MLAAttention
    from attn_ops.metadata import build_common_metadata

    spec = AttentionSpec.mla(b.heads, dtype=DTYPE, block_size=b.page)
    layer = MLAAttention(spec, AttentionConfig(backend=backend)).cuda()
    layer.load_kv_b_proj(torch.randn(b.heads * (NOPE + V), RANK, dtype=DTYPE, device="cuda")
                         / RANK ** 0.5)
    tables = b.block_table.tolist()
    common = build_common_metadata([1] * b.batch, [b.ctx] * b.batch, tables, b.page,
                                   b.cache.shape[0], device="cuda")
    meta = layer.impl.build_metadata(common)
    q = torch.randn(b.batch, b.heads, NOPE + ROPE, dtype=DTYPE, device="cuda")
    kv_c = torch.randn(b.batch, RANK, dtype=DTYPE, device="cuda")
    k_pe = torch.randn(b.batch, ROPE, dtype=DTYPE, device="cuda")
    out = torch.empty(b.batch, b.heads, V, dtype=DTYPE, device="cuda")
    return lambda: layer.impl.forward(q, kv_c, k_pe, b.cache, meta, out, w_uk=layer.w_uk,
                                      w_uv=layer.w_uv)


def flashinfer_mla(b: MLABatch, backend: str):
    import flashinfer

    ckv = b.cache[..., :RANK].contiguous()
    kpe = b.cache[..., RANK:].contiguous()
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(float_workspace_buffer=workspace,
                                                           backend=backend)
    pages = b.block_table.shape[1]
    kv_indptr = torch.arange(b.batch + 1, dtype=torch.int32, device="cuda") * pages
    wrapper.plan(qo_indptr=b.qsl, kv_indptr=kv_indptr, kv_indices=b.block_table.flatten(),
                 kv_len_arr=b.seq_lens, num_heads=b.heads, head_dim_ckv=RANK,
                 head_dim_kpe=ROPE, page_size=b.page, causal=False, sm_scale=b.scale,
                 q_data_type=DTYPE, kv_data_type=DTYPE)
    out = torch.empty_like(b.out)
    return lambda: wrapper.run(q_nope=b.ql, q_pe=b.q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out)


def main() -> None:
    parser = gpu_parser(__doc__, "bench_mla_decode_h200.json", page=64, rounds=2, quick=False)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--ctxs", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="extra TRITON_MLA tiles ROWSxKEYSxWARPSxSTAGES[xMAX_SPLITSxMIN_KEYS"
                             "[xVALUE_PARTS]] to time beside the tuned one (a sweep), e.g. "
                             "32x64x4x2 64x32x8x2x128x256 64x64x8x2x128x256x2")
    parser.add_argument("--no-ops", action="store_true", help="kernels only (a sweep)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for heads in args.heads:
        for batch in args.batches:
            for ctx in args.ctxs:
                b = MLABatch(heads, batch, ctx, args.page, gen)
                fns = {"triton_mla": triton_mla(b),
                       **{f"triton_mla_{tile}": triton_mla(b, tile) for tile in args.tiles}}
                for backend in ("TRITON_MLA", "FLASHINFER_MLA") if not args.no_ops else ():
                    try:
                        fns[f"{backend.lower()}_op"] = mla_op(b, backend)
                    except Exception as e:  # noqa: BLE001 -- a backend that cannot run here
                        print(f"{backend}: {type(e).__name__}: {e}"[:200])
                for backend in ("fa3", "fa2"):
                    try:
                        fns[f"flashinfer_{backend}"] = flashinfer_mla(b, backend)
                    except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here
                        print(f"flashinfer {backend}: {type(e).__name__}: {e}"[:200])
                outputs = {}
                for name in list(fns):
                    if not name.endswith("_op"):
                        try:
                            res = fns[name]()
                        except Exception as e:  # noqa: BLE001 -- a swept tile too big to build
                            print(f"{name}: {type(e).__name__}: {e}"[:200])
                            del fns[name]
                            continue
                        outputs[name] = (res if torch.is_tensor(res) else b.out).float().clone()
                # what Triton built for each TRITON_MLA launch: registers a thread, spills,
                # shared memory, whether the MMAs are Hopper's warpgroup MMAs
                built = {name: kernel_facts(fns[name]()) for name in fns
                         if name.startswith("triton_mla") and not name.endswith("_op")}
                # every kernel's output against TRITON_MLA's on the same latents: the
                # FlashInfer anchors and the swept tiles must compute the same attention
                checks = {name: cross_check(o, outputs["triton_mla"], TOLERANCE)
                          for name, o in outputs.items() if name != "triton_mla"}
                bad = [n for n, c in checks.items() if not c["agree"]]
                ms = time_graph(fns, args.rounds)
                eager = {k: eager_ms(fn) * 1e3 for k, fn in fns.items()}
                flops = batch * heads * ctx * 2 * (RANK + ROPE + RANK)
                nbytes = batch * ctx * (RANK + ROPE) * 2
                row = {"heads": heads, "batch": batch, "ctx": ctx,
                       "cross_check_vs_triton_mla": checks, "mismatch": bad,
                       **{f"{k}_built": v for k, v in built.items()},
                       **{f"{k}_ms": v for k, v in ms.items()},
                       **{f"{k}_tflops": flops / v / 1e9 for k, v in ms.items()},
                       **{f"{k}_tbs": nbytes / v / 1e9 for k, v in ms.items()},
                       "eager_us": eager}
                rows.append(row)
                print(f"H={heads:<4} B={batch:<4} ctx={ctx:<6} " + "  ".join(
                    f"{k}{'(MISMATCH)' if k in bad else ''} {flops / v / 1e9:6.1f} TF "
                    f"{nbytes / v / 1e9:5.2f} TB/s" for k, v in ms.items()) + "  (graph)")
                print("    eager: " + "  ".join(f"{k} {v:.1f} us" for k, v in eager.items()))
                for name in bad:
                    print(f"    {name}: {check_text(checks[name])}")
                print("    built: " + "  ".join(f"{k} {v}" for k, v in built.items()))
                write_result("bench_mla_decode", args.out, quiet=True, page=args.page,
                             rows=rows, complete=False)
                del b, fns, outputs
    write_result("bench_mla_decode", args.out, page=args.page, rows=rows, complete=True)


if __name__ == "__main__":
    main()
