"""Sparse MLA decode on the H200: one layer's step -- the indexer (index-key write, top-k,
slots) and the sparse attention -- against dense MLA over the same latent cache, side by side
in one run.

DeepSeek-V3.2 shapes: 128 heads, latent 512 + rope 64, QK 192 / V 128, bf16 latents, page 64
(pages in random order); the indexer's 64 heads x 128 over an fp8 e4m3 index-key cache with
per-token scales, top-k 2048. ``batch`` requests of ``ctx`` cached tokens, one new token each.
Contenders, each as CUDA-graph replays (``do_bench_cudagraph`` medians, contenders in turn;
the projections are the model's and are not timed on either side):

* ``indexer``     -- ``attn.indexer_k_write`` + ``attn.indexer_topk`` + ``attn.indexer_slots``;
* ``sparse_attn`` -- the sparse layer (latent write, absorption, TRITON_MLA_SPARSE over the
  2048 selected rows, ``W_UV``) on slots the indexer chose;
* ``sparse_step`` -- both, as a sparse layer's step runs them;
* ``dense_<B>``   -- the dense MLA layer on backend ``B`` (``--dense``; default TRITON_MLA and
  FLASHINFER_MLA, the dense MLA family's best at 128 heads), metadata planned before capture.

    python benchmarks/bench_mla_sparse.py [--batches 1 8 64 128] [--ctxs 8192 ...]
        [--dense TRITON_MLA FLASHINFER_MLA] [--rounds R] [--out PATH]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_attention import gpu_parser, time_graph, write_result  # noqa: E402

HEADS, PAGE, TOPK, INDEX_HEADS, INDEX_DIM = 128, 64, 2048, 64, 128
BF16 = torch.bfloat16


def case(batch: int, ctx: int, dense: list[str], gen: torch.Generator) -> dict:
    """The contenders of one point, over one latent cache and one index-key cache."""
    from attn_ops import AttentionConfig, AttentionSpec, MLAAttention
    from attn_ops.backends.mla.indexer import (FP8, allocate_index_cache, indexer_k_write,
                                               indexer_slots, indexer_topk)
    from attn_ops.metadata import CommonAttentionMetadata

    pages = -(-(ctx + 1) // PAGE)
    blocks = batch * pages
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, pages).cuda()
    seq = torch.full((batch,), ctx + 1, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    slot = (table[:, ctx // PAGE].long() * PAGE + ctx % PAGE).contiguous()
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq, seq_lens_cpu=seq.cpu(),
        block_table=table, slot_mapping=slot, num_actual_tokens=batch, max_query_len=1,
        max_seq_len=ctx + 1, num_decodes=batch, num_decode_tokens=batch, block_size=PAGE,
        block_table_cpu=table.cpu(), num_blocks=blocks)
    sparse_spec = AttentionSpec.mla(HEADS, dtype=BF16, block_size=PAGE, index_topk=TOPK)
    layers = {"sparse": MLAAttention(sparse_spec, AttentionConfig(
        backend="TRITON_MLA_SPARSE")).cuda()}
    for name in dense:
        layers[name] = MLAAttention(sparse_spec.with_(index_topk=None),
                                    AttentionConfig(backend=name)).cuda()
    w = (torch.randn(HEADS * 256, 512, device="cuda") / 512 ** 0.5).to(BF16)
    for layer in layers.values():
        layer.load_kv_b_proj(w)
    latent = torch.randn(blocks, PAGE, 576, device="cuda", dtype=BF16)
    keys, scales = allocate_index_cache(blocks, PAGE, INDEX_DIM, FP8, device="cuda")
    keys.copy_(torch.randn(keys.shape, device="cuda").to(FP8))
    scales.uniform_(0.01, 0.1)
    q_idx = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=BF16)
    k_idx = torch.randn(batch, INDEX_DIM, device="cuda", dtype=BF16)
    weights = torch.randn(batch, INDEX_HEADS, device="cuda")
    q = torch.randn(batch, HEADS, 192, device="cuda", dtype=BF16)
    kv_c = torch.randn(batch, 512, device="cuda", dtype=BF16)
    k_pe = torch.randn(batch, 64, device="cuda", dtype=BF16)
    chosen = {}

    def indexer():
        indexer_k_write(k_idx, keys, scales, slot)
        positions = indexer_topk(q_idx, weights, keys, scales, table, seq, qsl, TOPK)
        chosen["slots"] = indexer_slots(positions, table, qsl, PAGE)
        return chosen["slots"]

    indexer()
    slots = chosen["slots"].clone()
    sparse = layers["sparse"]
    fns = {"indexer": indexer,
           "sparse_attn": lambda: sparse(q, kv_c, k_pe, latent, common, topk_slots=slots),
           "sparse_step": lambda: sparse(q, kv_c, k_pe, latent, common, topk_slots=indexer())}
    for name in dense:
        layer = layers[name]
        built = layer.impl.build_metadata(common)  # (host planning outside the capture)
        fns[f"dense_{name}"] = (lambda layer=layer, built=built:
                                layer(q, kv_c, k_pe, latent, built))
    return fns


def main() -> None:
    parser = gpu_parser(__doc__, "bench_mla_sparse_h200.json", page=PAGE, rounds=1,
                        quick=False)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--ctxs", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--dense", nargs="*", default=["TRITON_MLA", "FLASHINFER_MLA"])
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batches:
        for ctx in args.ctxs:
            fns = case(batch, ctx, args.dense, gen)
            ms, errors = {}, {}
            for name, fn in fns.items():  # (a contender that cannot run here is recorded)
                try:
                    ms.update(time_graph({name: fn}, args.rounds))
                except Exception as e:  # noqa: BLE001
                    errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{name}: {errors[name]}", flush=True)
            row = {"batch": batch, "ctx": ctx, **{f"{n}_us": v * 1e3 for n, v in ms.items()},
                   "errors": errors}
            best_dense = min((v for n, v in ms.items() if n.startswith("dense_")),
                             default=float("nan"))
            step = ms.get("sparse_step", float("nan"))
            row["speedup_vs_dense"] = best_dense / step
            row["indexer_share"] = ms.get("indexer", float("nan")) / step
            rows.append(row)
            print(f"B={batch:<4d} ctx={ctx:<7d} " + "  ".join(
                f"{n} {v * 1e3:8.1f} us" for n, v in ms.items())
                + f"  x{row['speedup_vs_dense']:.2f} vs dense, indexer "
                f"{100 * row['indexer_share']:.0f}%", flush=True)
            write_result("bench_mla_sparse", args.out, quiet=True, rows=rows, complete=False,
                         dense=args.dense)
            del fns
            torch.cuda.empty_cache()
    write_result("bench_mla_sparse", args.out, rows=rows, complete=True, dense=args.dense)


if __name__ == "__main__":
    main()
