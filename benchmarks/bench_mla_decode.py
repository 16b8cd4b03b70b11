"""MLA decode: our MLA backends against FlashMLA and FlashInfer's MLA kernels, kernel alone
and as vLLM runs them, side by side in one run (H200).

The same latent rows (bf16, DeepSeek dims: ``kv_lora_rank`` 512 + rope 64, page 64, pages in
random order), one query token per request, ``heads`` query heads:

* kernels on the same absorbed queries ``ql`` / ``q_pe`` (cross-checked against
  ``triton_mla``'s output, ``cross_check_vs_triton_mla``):
  ``triton_mla`` -- TRITON_MLA's absorbed launch (kernel + split combine), launch from
  ``routing.mla_decode_launch``; ``flashmla`` -- FlashMLA's ``flash_mla_with_kvcache`` (from
  whichever provider imports), its tile schedule computed before timing; ``fa3_mla`` --
  FlashAttention 3's MLA path (``q_v``) as FLASH_ATTN_MLA calls it; ``flashinfer_fa3`` /
  ``flashinfer_fa2`` (``--fa2``) -- ``flashinfer.mla.BatchMLAPagedAttentionWrapper``, planned
  before timing, on contiguous ``ckv`` / ``kpe`` caches holding the same rows;
* whole decode steps from the same ``q`` (nope + rope) and ``kv_b_proj`` weights, each
  cross-checked against ``vllm_flashmla``'s output (``cross_check_vs_vllm_flashmla``):
  ``vllm_flashmla`` / ``vllm_flashinfer_fa3`` -- as vLLM runs the kernel: ``q_nope @ W_UK`` and
  ``out @ W_UV`` as torch bmm around it (the queries concatenated for FlashMLA);
  ``<backend>_op`` -- our whole MLA op of a step (absorption, the new token's latent write, the
  kernel the backend routes to, ``@ W_UV``), metadata built before timing.

A contender that disagrees is printed ``name(MISMATCH)`` with its errors and listed in the
row's ``mismatch``; no ratio is printed for it. Libraries are called by keyword. Each is timed
as CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), contenders interleaved
over ``--rounds`` rounds, and eagerly (calls back to back, ``eager_us``). FLOPs = B * H * ctx * 2
* (576 + 512) -> TFLOP/s; bytes = B * ctx * 576 * 2 -> TB/s; both are reported. The row's
``best_vllm`` names the fastest as-vLLM path that agreed and ``selected_vs_best_vllm`` is its
time over the selected backend's op time.

    python benchmarks/bench_mla_decode.py [--heads 16 128] [--batches ...] [--ctxs ...]
        [--tiles 32x64x4x2 ...] [--no-ops] [--fa2] [--backends ...] [--rounds R] [--out PATH]
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
        # a whole step's inputs: the query before absorption, the new token's latent, weights
        self.q = torch.randn(batch, heads, NOPE + ROPE, dtype=DTYPE, device="cuda")
        self.kv_c = torch.randn(batch, RANK, dtype=DTYPE, device="cuda")
        self.k_pe = torch.randn(batch, ROPE, dtype=DTYPE, device="cuda")
        self.kv_b = torch.randn(heads * (NOPE + V), RANK, dtype=DTYPE, device="cuda") / RANK ** 0.5
        w = self.kv_b.view(heads, NOPE + V, RANK)
        self.w_uk, self.w_uv = w[:, :NOPE], w[:, NOPE:].transpose(1, 2)  # [H,nope,r], [H,r,v]


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


def mla_op(b: MLABatch, backend: str | None):
    """``backend``'s whole op (None: the one selected here) on the decode step of ``b``,
    metadata (and any plan) built before timing; returns the step's output."""
    from attn_ops import AttentionConfig, AttentionSpec, MLAAttention
    from attn_ops.metadata import build_common_metadata

    spec = AttentionSpec.mla(b.heads, dtype=DTYPE, block_size=b.page)
    layer = MLAAttention(spec, AttentionConfig(backend=backend)).cuda()
    layer.load_kv_b_proj(b.kv_b)
    tables = b.block_table.tolist()
    common = build_common_metadata([1] * b.batch, [b.ctx] * b.batch, tables, b.page,
                                   b.cache.shape[0], device="cuda")
    meta = layer.impl.build_metadata(common)
    out = torch.empty(b.batch, b.heads, V, dtype=DTYPE, device="cuda")

    def step():
        layer.impl.forward(b.q, b.kv_c, b.k_pe, b.cache, meta, out, w_uk=layer.w_uk,
                           w_uv=layer.w_uv)
        return out
    return step, layer.impl.name


def flashmla_kernel(b: MLABatch):
    """FlashMLA's decode on ``ql`` / ``q_pe``, its tile schedule computed before timing (as a
    step's later layers reuse it)."""
    from attn_ops.providers import FLASHMLA

    _, fm = FLASHMLA.require("FLASHMLA")
    k_cache = b.cache.unsqueeze(2)
    meta = [None, None]
    out = torch.empty(b.batch, 1, b.heads, RANK, dtype=DTYPE, device="cuda")

    def run(ql, q_pe):
        q = torch.cat([ql, q_pe], dim=-1).unsqueeze(1)
        if meta[0] is None:
            meta[:] = (fm.get_mla_metadata()[0], None) if hasattr(fm, "FlashMLASchedMeta") \
                else fm.get_mla_metadata(b.seq_lens, b.heads, 1)
        return fm.flash_mla_with_kvcache(q=q, k_cache=k_cache, block_table=b.block_table,
                                         cache_seqlens=b.seq_lens, head_dim_v=RANK,
                                         tile_scheduler_metadata=meta[0], num_splits=meta[1],
                                         softmax_scale=b.scale, causal=False)[0].squeeze(1)
    return run


def fa3_mla_kernel(b: MLABatch):
    """FlashAttention 3's MLA path on ``ql`` / ``q_pe`` as FLASH_ATTN_MLA calls it."""
    from attn_ops.backends.mla.common import PLAN, MLAPlan
    from attn_ops.backends.mla.flash_attn_mla import absorbed_fa3

    plan = PLAN.decode(PLAN.encode(MLAPlan(num_absorbed=b.batch, num_absorbed_tokens=b.batch,
                                           num_tokens=b.batch, chunk_tokens=0,
                                           absorbed_max_query_len=1)))
    out = torch.empty_like(b.out)

    def run(ql, q_pe):
        absorbed_fa3(ql, q_pe, b.cache, b.qsl, b.seq_lens, b.block_table, out, None, b.scale,
                     plan)
        return out
    return run


def as_vllm(b: MLABatch, kernel):
    """A decode step as vLLM runs it around ``kernel(ql, q_pe) -> [B, H, rank]``: the
    absorption and the value up-projection as torch bmm over the heads."""
    q_nope, q_pe = b.q[..., :NOPE], b.q[..., NOPE:]

    def step():
        ql = torch.bmm(q_nope.transpose(0, 1), b.w_uk).transpose(0, 1)
        return torch.bmm(kernel(ql, q_pe).transpose(0, 1), b.w_uv).transpose(0, 1)
    return step


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
    return lambda ql, q_pe: wrapper.run(q_nope=ql, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe,
                                        out=out)


def contenders(b: MLABatch, args) -> tuple[dict, dict, str | None]:
    """``(kernels, steps, selected)``: the kernel contenders on ``ql`` / ``q_pe``, the whole
    decode steps (as vLLM runs them, our ops), the selected backend's op name."""
    kernels = {"triton_mla": triton_mla(b),
               **{f"triton_mla_{tile}": triton_mla(b, tile) for tile in args.tiles}}
    library = {"flashmla": lambda: flashmla_kernel(b), "fa3_mla": lambda: fa3_mla_kernel(b),
               "flashinfer_fa3": lambda: flashinfer_mla(b, "fa3"),
               **({"flashinfer_fa2": lambda: flashinfer_mla(b, "fa2")} if args.fa2 else {})}
    steps, selected = {}, None
    for name, make in library.items():
        try:
            kernel = make()
        except Exception as e:  # noqa: BLE001 -- a library that cannot run here
            print(f"{name}: {type(e).__name__}: {e}"[:200])
            continue
        kernels[name] = lambda kernel=kernel: kernel(b.ql, b.q_pe)
        if name in ("flashmla", "flashinfer_fa3") and not args.no_ops:
            steps[f"vllm_{name}"] = as_vllm(b, kernel)
    for backend in ([None, *args.backends] if not args.no_ops else ()):
        try:
            step, name = mla_op(b, backend)
        except Exception as e:  # noqa: BLE001 -- a backend that cannot run here
            print(f"{backend}: {type(e).__name__}: {e}"[:200])
            continue
        if backend is None:
            selected = f"{name.lower()}_op"
        steps[f"{name.lower()}_op"] = step
    return kernels, steps, selected


def main() -> None:
    parser = gpu_parser(__doc__, "bench_mla_decode_h200.json", page=64, rounds=2, quick=False)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--ctxs", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="extra TRITON_MLA tiles ROWSxKEYSxWARPSxSTAGES[xMAX_SPLITSxMIN_KEYS"
                             "[xVALUE_PARTS]] to time beside the tuned one (a sweep), e.g. "
                             "32x64x4x2 64x32x8x2x128x256 64x64x8x2x128x256x2")
    parser.add_argument("--backends", nargs="*",
                        default=["TRITON_MLA", "FLASHINFER_MLA", "FLASHMLA", "FLASH_ATTN_MLA"],
                        help="MLA backends whose whole op is timed beside the selected one")
    parser.add_argument("--no-ops", action="store_true", help="kernels only (a sweep)")
    parser.add_argument("--fa2", action="store_true", help="also FlashInfer's fa2 MLA kernel")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for heads in args.heads:
        for batch in args.batches:
            for ctx in args.ctxs:
                b = MLABatch(heads, batch, ctx, args.page, gen)
                kernels, steps, selected = contenders(b, args)
                # the ops first: each writes its step's new latent row into the cache (the
                # same row every time), which every later call then reads
                step_out = {name: fn().float().clone() for name, fn in steps.items()}
                outputs = {}
                for name in list(kernels):
                    try:
                        res = kernels[name]()
                    except Exception as e:  # noqa: BLE001 -- a swept tile too big to build
                        print(f"{name}: {type(e).__name__}: {e}"[:200])
                        del kernels[name]
                        continue
                    outputs[name] = (res if torch.is_tensor(res) else b.out).float().clone()
                # what Triton built for each TRITON_MLA launch: registers a thread, spills,
                # shared memory, whether the MMAs are Hopper's warpgroup MMAs
                built = {name: kernel_facts(kernels[name]()) for name in kernels
                         if name.startswith("triton_mla")}
                # every kernel against TRITON_MLA's on the same latents, every step against
                # vLLM's FlashMLA step: the same attention, or no ratio
                checks = {name: cross_check(o, outputs["triton_mla"], TOLERANCE)
                          for name, o in outputs.items() if name != "triton_mla"}
                anchor = step_out.get("vllm_flashmla")
                checks.update({name: cross_check(o, anchor, TOLERANCE)
                               for name, o in step_out.items()
                               if anchor is not None and name != "vllm_flashmla"})
                bad = [n for n, c in checks.items() if not c["agree"]]
                fns = {**kernels, **steps}
                ms = time_graph(fns, args.rounds)
                eager = {k: eager_ms(fn) * 1e3 for k, fn in fns.items()}
                flops = batch * heads * ctx * 2 * (RANK + ROPE + RANK)
                nbytes = batch * ctx * (RANK + ROPE) * 2
                vllm = {k: v for k, v in ms.items() if k.startswith("vllm_") and k not in bad}
                best = min(vllm, key=vllm.get) if vllm else None
                ratio = (vllm[best] / ms[selected] if best and selected in ms
                         and selected not in bad else None)
                row = {"heads": heads, "batch": batch, "ctx": ctx, "selected": selected,
                       "best_vllm": best, "selected_vs_best_vllm": ratio,
                       "cross_check_vs_triton_mla": {k: v for k, v in checks.items()
                                                     if k in outputs},
                       "cross_check_vs_vllm_flashmla": {k: v for k, v in checks.items()
                                                        if k in step_out},
                       "mismatch": bad,
                       **{f"{k}_built": v for k, v in built.items()},
                       **{f"{k}_ms": v for k, v in ms.items()},
                       **{f"{k}_tflops": flops / v / 1e9 for k, v in ms.items()},
                       **{f"{k}_tbs": nbytes / v / 1e9 for k, v in ms.items()},
                       "eager_us": eager}
                rows.append(row)
                print(f"H={heads:<4} B={batch:<4} ctx={ctx:<6} " + "  ".join(
                    f"{k}{'(MISMATCH)' if k in bad else ''} {flops / v / 1e9:6.1f} TF "
                    f"{nbytes / v / 1e9:5.2f} TB/s" for k, v in ms.items()) + "  (graph)")
                print(f"    selected {selected} vs best as-vLLM {best}: "
                      + (f"{ratio:.3f}x" if ratio else "no ratio"))
                print("    eager: " + "  ".join(f"{k} {v:.1f} us" for k, v in eager.items()))
                for name in bad:
                    print(f"    {name}: {check_text(checks[name])}")
                print("    built: " + "  ".join(f"{k} {v}" for k, v in built.items()))
                write_result("bench_mla_decode", args.out, quiet=True, page=args.page,
                             rows=rows, complete=False)
                del b, fns, kernels, steps, outputs, step_out
    write_result("bench_mla_decode", args.out, page=args.page, rows=rows, complete=True)
    print("\nheads  B    ctx    selected op         TF/s (TB/s)    best as-vLLM          TF/s"
          "    ratio")
    for r in rows:
        sel, best = r["selected"], r["best_vllm"]
        cell = lambda k: (f"{r[k + '_tflops']:6.1f} ({r[k + '_tbs']:.2f})"  # noqa: E731
                          if k and f"{k}_ms" in r else "      -      ")
        print(f"{r['heads']:<6} {r['batch']:<4} {r['ctx']:<6} {sel or '-':<19} {cell(sel)}  "
              f"{best or '-':<21} {cell(best)}  "
              + (f"{r['selected_vs_best_vllm']:.3f}x" if r["selected_vs_best_vllm"] else "-"))


if __name__ == "__main__":
    main()
