"""MLA prefill (the MHA form): the layer's op and its kernel glue against the kernels called
directly on the same tensors, side by side in one run (H200).

DeepSeek dims (128 heads, QK 128 + 64 / V 128, latent 512 + 64), bf16, page 64, causal. Cases:
prefills 1x8k, 4x4k, 16x1k without context, and one request of 4k new tokens over 28k cached.

* ``fa4_direct``    -- FlashAttention 4's varlen forward on the up-projected q / k / v (the
  kernel alone; for the context case one call over all 32k keys);
* ``flashinfer_ragged`` -- FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (fa3), planned
  before timing, on the same tensors;
* ``glue_fa4`` / ``glue_flashinfer`` -- our MHA kernel glue (``backends.mla.prefill``:
  ``mha_fa4``; ``mha_flashinfer``, its host plan at each call included) on them, with the LSE;
  the row's ``routing_pick`` is the one ``mha_kernel`` picks here;
* ``layer_op``      -- the whole TRITON_MLA op of the step (up-projection of the new tokens,
  the context gathered and up-projected in chunks of ``Tuning.mla.context_chunk_tokens``,
  merged through the LSE); ``layer_op_one_chunk`` the same with the context in one chunk --
  their difference is the chunked merge's cost.

Every contender's output is cross-checked against ``layer_op``'s on the same tensors first
(``cross_check_vs_layer_op``, ``bench_gpu_attention.TOLERANCE``); one that disagrees is printed
``name(MISMATCH)`` with its errors and listed in ``mismatch``, and the merge overhead is left
out where the two layer ops disagree. FA4 and FlashInfer are called by keyword.

FLOPs: causal 4 * H * sum_r(n_r * (c_r + (n_r + 1) / 2)) * (192 + 128) / 2 per request with
``n`` new and ``c`` cached tokens. Eager times: ``triton.testing.do_bench`` medians (ms; at these
sizes device time; ``glue_flashinfer`` plans on the host at each call, so it is not captured
in CUDA graphs), contenders interleaved over ``--rounds``.

    python benchmarks/bench_mla_prefill.py [--rounds R] [--out PATH]
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import check_text, checked_ratio, cross_check  # noqa: E402
from bench_gpu_attention import TOLERANCE, gpu_parser, write_result  # noqa: E402

HEADS, RANK, ROPE, NOPE, V = 128, 512, 64, 128, 128
DTYPE = torch.bfloat16
CASES = {"1x8k": ([8192], [0]), "4x4k": ([4096] * 4, [0] * 4), "16x1k": ([1024] * 16, [0] * 16),
         "4k_over_28k": ([4096], [28672])}


def flops(new, ctx) -> float:
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in zip(new, ctx))
    return 2 * HEADS * pairs * (NOPE + ROPE + V)


def setup(new, ctx, page, gen, chunk):
    """The layer, its latent cache holding the context, the step's inputs and metadata."""
    from attn_ops import AttentionConfig, AttentionSpec, BlockAllocator, MLAAttention
    from attn_ops.backends.mla.common import mla_cache_update
    from attn_ops.metadata import build_batch
    from attn_ops.tuning import default_tuning

    spec = AttentionSpec.mla(HEADS, dtype=DTYPE, block_size=page)
    tuning = default_tuning().with_(mla={"context_chunk_tokens": chunk})
    layer = MLAAttention(spec, AttentionConfig(backend="TRITON_MLA", tuning=tuning)).cuda()
    layer.load_kv_b_proj(torch.randn(HEADS * (NOPE + V), RANK, generator=gen).to(DTYPE)
                         .cuda() / RANK ** 0.5)
    blocks = sum(-(-(n + c) // page) for n, c in zip(new, ctx)) + 1
    alloc = BlockAllocator(blocks, page, shuffle=True, seed=0)
    cache = layer.allocate_cache(blocks, "cuda")
    reqs = list(range(len(new)))
    with_ctx = [r for r in reqs if ctx[r]]
    if with_ctx:
        pre = build_batch(alloc, with_ctx, [0] * len(with_ctx), [ctx[r] for r in with_ctx],
                          device="cuda", decode_threshold=0)
        rows = pre.slot_mapping.shape[0]
        mla_cache_update(torch.randn(rows, RANK, device="cuda", dtype=DTYPE),
                         torch.randn(rows, ROPE, device="cuda", dtype=DTYPE), cache,
                         pre.slot_mapping, None)
    common = build_batch(alloc, reqs, ctx, new, device="cuda", decode_threshold=0)
    t = sum(new)
    q = torch.randn(t, HEADS, NOPE + ROPE, device="cuda", dtype=DTYPE)
    kv_c = torch.randn(t, RANK, device="cuda", dtype=DTYPE)
    k_pe = torch.randn(t, ROPE, device="cuda", dtype=DTYPE)
    return layer, cache, common, q, kv_c, k_pe


def main() -> None:
    from triton.testing import do_bench

    from attn_ops.backends.mla.common import _up_project
    from attn_ops.backends.mla.prefill import (_fa4_usable, _flashinfer_usable, mha_fa4,
                                               mha_flashinfer, mha_kernel)

    parser = gpu_parser(__doc__, "bench_mla_prefill_h200.json", page=64, rounds=3, quick=False)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (new, ctx) in CASES.items():
        layer, cache, common, q, kv_c, k_pe = setup(new, ctx, args.page, gen, 4096)
        meta = layer.impl.build_metadata(common)
        # the same layer's backend with the whole context in one chunk, on the same tensors
        one_chunk = type(layer.impl)(layer.spec, tuning=layer.tuning.with_(
            mla={"context_chunk_tokens": 1 << 20}))
        one_meta = one_chunk.build_metadata(common)
        # the same keys for the direct kernels: the context's latents (from the cache) and the
        # new tokens', up-projected once
        lat = torch.cat([cache.view(-1, RANK + ROPE).index_select(0, s) for s in meta.chunk_slots]
                        ) if meta.chunk_slots else cache.new_zeros(0, RANK + ROPE)
        k_all, v_all = _up_project(torch.cat([lat[:, :RANK], kv_c]),
                                   torch.cat([lat[:, RANK:], k_pe]), layer.w_uk, layer.w_uv)
        cu_q = [0, *torch.tensor(new).cumsum(0).tolist()]
        cu_k = [0, *torch.tensor([n + c for n, c in zip(new, ctx)]).cumsum(0).tolist()]
        if sum(ctx):  # (one request: its context rows, then its new rows)
            assert len(new) == 1
        t = sum(new)
        out = torch.empty(t, HEADS, V, device="cuda", dtype=DTYPE)
        lse = torch.empty(t, HEADS, device="cuda")
        cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device="cuda")
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device="cuda")
        scale = layer.impl.scale
        pick = mha_kernel(q.device, NOPE + ROPE, V, len(new),
                          layer.tuning.mla.flashinfer_prefill_max_requests).__name__
        glue = lambda mha: lambda: mha(q, k_all, v_all, cu_q_t, cu_k_t, cu_q, cu_k,  # noqa: E731
                                       out, lse, scale, True)
        fns = {**({"glue_fa4": glue(mha_fa4)} if _fa4_usable(q.device, NOPE + ROPE, V) else {}),
               **({"glue_flashinfer": glue(mha_flashinfer)}
                  if _flashinfer_usable(q.device, NOPE + ROPE, V) else {}),
               "layer_op": lambda: layer.impl.forward(q, kv_c, k_pe, cache, meta, out,
                                                      w_uk=layer.w_uk, w_uv=layer.w_uv),
               "layer_op_one_chunk": lambda: one_chunk.forward(
                   q, kv_c, k_pe, cache, one_meta, out, w_uk=layer.w_uk, w_uv=layer.w_uv)}
        try:
            from flash_attn.cute.interface import _flash_attn_fwd

            fns["fa4_direct"] = lambda: _flash_attn_fwd(
                q=q, k=k_all, v=v_all, cu_seqlens_q=cu_q_t, cu_seqlens_k=cu_k_t,
                max_seqlen_q=max(new), max_seqlen_k=max(n + c for n, c in zip(new, ctx)),
                softmax_scale=scale, causal=True)
        except Exception as e:  # noqa: BLE001 -- an anchor that cannot run here
            print(f"fa4: {type(e).__name__}: {e}"[:200])
        try:
            import flashinfer

            ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
            wrapper = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(
                float_workspace_buffer=ws, kv_layout="NHD", backend="fa3")
            wrapper.plan(qo_indptr=cu_q_t, kv_indptr=cu_k_t, num_qo_heads=HEADS,
                         num_kv_heads=HEADS, head_dim_qk=NOPE + ROPE, head_dim_vo=V,
                         causal=True, sm_scale=scale, q_data_type=DTYPE)
            fns["flashinfer_ragged"] = lambda: wrapper.run(q=q, k=k_all, v=v_all)
        except Exception as e:  # noqa: BLE001
            print(f"flashinfer ragged: {type(e).__name__}: {e}"[:200])
        # every contender's output against the layer's on the same tensors: the kernels
        # called directly must compute the layer's attention for their times to compare
        def output(fn):
            out.zero_()
            res = fn()
            got = res[0] if isinstance(res, tuple) else (res if torch.is_tensor(res) else out)
            return got.float().clone()

        ref = output(fns["layer_op"])
        checks = {k: cross_check(output(fn), ref, TOLERANCE) for k, fn in fns.items()
                  if k != "layer_op"}
        del ref
        bad = [k for k, c in checks.items() if not c["agree"]]
        samples = {k: [] for k in fns}
        for r in range(args.rounds):
            names = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
            for k in names:
                samples[k].append(do_bench(fns[k], rep=100, return_mode="median"))
        ms = {k: statistics.median(v) for k, v in samples.items()}
        amount = flops(new, ctx)
        row = {"case": name, "new": new, "ctx": ctx, "routing_pick": pick,
               "cross_check_vs_layer_op": checks, "mismatch": bad,
               **{f"{k}_ms": v for k, v in ms.items()},
               **{f"{k}_tflops": amount / v / 1e9 for k, v in ms.items()}}
        if "layer_op_one_chunk" in ms and sum(ctx):  # (only where both computed the same)
            merge = checked_ratio(ms["layer_op_one_chunk"], ms["layer_op"],
                                  checks["layer_op_one_chunk"])
            row["chunk_merge_overhead"] = None if merge is None else merge - 1
        rows.append(row)
        print(f"{name:12s} " + "  ".join(f"{k}{'(MISMATCH)' if k in bad else ''} "
                                         f"{amount / v / 1e9:6.1f} TF" for k, v in ms.items()))
        for k in bad:
            print(f"    {k}: {check_text(checks[k])}")
        write_result("bench_mla_prefill", args.out, quiet=True, rows=rows, complete=False)
    write_result("bench_mla_prefill", args.out, rows=rows, complete=True)


if __name__ == "__main__":
    main()
