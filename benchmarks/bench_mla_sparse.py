"""Sparse MLA decode on the H200: one layer's step -- the indexer (index-key write, top-k,
slots) and the sparse attention -- against dense MLA over the same latent cache, side by side
in one run.

DeepSeek-V3.2 shapes: 128 heads, latent 512 + rope 64, QK 192 / V 128, bf16 latents, page 64
(pages in random order); the indexer's 64 heads x 128 over an fp8 e4m3 index-key cache with
per-token scales, top-k 2048. ``batch`` requests of ``ctx`` cached tokens, one new token each.
Contenders, each as CUDA-graph replays (``do_bench_cudagraph`` medians, contenders in turn;
``eager_us``: calls back to back; the projections are the model's and are not timed on either
side):

* ``indexer``     -- ``attn.indexer_k_write`` + ``attn.indexer_topk`` + ``attn.indexer_slots``;
* ``sparse_attn_<B>`` -- the sparse layer on backend ``B`` (``--sparse``; default
  TRITON_MLA_SPARSE, FLASHINFER_MLA_SPARSE, FLASHMLA_SPARSE (its prefill kernel over the bf16
  cache) and ``FLASHMLA_SPARSE:fp8_ds_mla``): latent write, absorption, attention over the 2048
  selected rows, ``W_UV``, on slots the indexer chose; ``B:fp8_ds_mla`` reads FlashMLA's
  fp8_ds_mla cache (656 bytes a token) holding the same latents (the bf16 cache and the new
  tokens' latents hold what the fp8 layout decodes to, so every backend attends over the same
  values);
* ``sparse_step_<B>`` -- the indexer and ``sparse_attn_<B>``, as a sparse layer's step runs them;
* ``kernel_flashmla_sparse_<bf16|fp8>`` / ``vllm_flashmla_sparse_<bf16|fp8>`` (decode, where
  FLASHMLA_SPARSE runs) -- FlashMLA's sparse prefill kernel over the bf16 cache and its fp8
  decode over the fp8_ds_mla one, alone and as vLLM runs them (absorption and ``W_UV`` as
  torch bmm around the kernel), the latter cross-checked with the layers;
* ``dense_<B>``   -- the dense MLA layer on backend ``B`` (``--dense``; default TRITON_MLA,
  FLASHINFER_MLA and COMPOSITE_MLA_SM90, the dense MLA family's best at 128 heads), metadata
  planned before capture.

``--only prefill``: one request's prefill of ``--prefills`` tokens from an empty cache -- the
sparse steps (every token over its ``min(2048, position + 1)`` selected rows, absorbed) against
the dense layer's (the MHA form, routed to FA4 / FlashInfer's ragged prefill), timed with
``do_bench`` (the dense MHA part plans on the host at each call). TFLOP/s: the selected
tokens' attention, ``sum_t count_t * H * 2 * (576 + 512)``, and the dense causal MHA's,
``n^2 / 2 * H * 2 * (192 + 128)``.

The sparse backends' outputs are cross-checked at every point against the first sparse
backend's that ran (``cross_check``, ``bench_gpu_attention.TOLERANCE``); where they disagree
the point's ``speedup_vs_dense`` is refused ("mismatch"). The dense layers compute attention
over every row, so their outputs cannot be checked against the sparse ones: that ratio is the
cost a sparse step saves, not a comparison of one computation.

    python benchmarks/bench_mla_sparse.py [--only decode prefill] [--batches 1 8 64 128]
        [--ctxs 8192 ...] [--prefills 4096 16384] [--dense TRITON_MLA FLASHINFER_MLA]
        [--sparse TRITON_MLA_SPARSE FLASHINFER_MLA_SPARSE FLASHMLA_SPARSE:fp8_ds_mla]
        [--rounds R] [--out PATH]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cross_check, eager_ms, ratio_text  # noqa: E402
from bench_gpu_attention import TOLERANCE, gpu_parser, time_graph, write_result  # noqa: E402

HEADS, PAGE, TOPK, INDEX_HEADS, INDEX_DIM = 128, 64, 2048, 64, 128
BF16 = torch.bfloat16


def case(batch: int, ctx: int, sparse: list[str], dense: list[str], gen: torch.Generator,
         new_tokens: int = 1) -> tuple[dict, dict]:
    """The contenders of one point -- ``batch`` requests of ``ctx`` cached tokens and
    ``new_tokens`` new ones each -- over one latent cache and one index-key cache, and the
    sparse backends' outputs cross-checked against the first's (``{backend: check}``)."""
    from attn_ops import AttentionConfig, AttentionSpec, MLAAttention
    from attn_ops.backends.mla.indexer import (FP8, allocate_index_cache, indexer_k_write,
                                               indexer_slots, indexer_topk)
    from attn_ops.metadata import CommonAttentionMetadata

    n, length = new_tokens, ctx + new_tokens
    t = batch * n
    pages = -(-length // PAGE)
    blocks = batch * pages
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, pages).cuda()
    seq = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * n
    pos = ctx + torch.arange(n, device="cuda")
    slot = (table[:, pos // PAGE].long() * PAGE + pos % PAGE).reshape(-1)
    decode = n == 1
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq, seq_lens_cpu=seq.cpu(),
        block_table=table, slot_mapping=slot, num_actual_tokens=t, max_query_len=n,
        max_seq_len=length, num_decodes=batch if decode else 0,
        num_decode_tokens=t if decode else 0, block_size=PAGE, block_table_cpu=table.cpu(),
        num_blocks=blocks)
    sparse_spec = AttentionSpec.mla(HEADS, dtype=BF16, block_size=PAGE, index_topk=TOPK)
    ds_spec = sparse_spec.with_(kv_cache_dtype="fp8_ds_mla")
    layers, ds = {}, set()
    for name in sparse:  # ("NAME:fp8_ds_mla": the backend over FlashMLA's fp8 layout)
        backend, _, layout = name.partition(":")
        spec = ds_spec if layout == "fp8_ds_mla" else sparse_spec
        layers[f"sparse_{name}"] = MLAAttention(spec, AttentionConfig(backend=backend)).cuda()
        if layout == "fp8_ds_mla":
            ds.add(f"sparse_{name}")
    for name in dense:
        layers[f"dense_{name}"] = MLAAttention(sparse_spec.with_(index_topk=None),
                                               AttentionConfig(backend=name)).cuda()
    w = (torch.randn(HEADS * 256, 512, device="cuda") / 512 ** 0.5).to(BF16)
    for layer in layers.values():
        layer.load_kv_b_proj(w)
    latent = torch.randn(blocks, PAGE, 576, device="cuda", dtype=BF16)
    latent_ds = None
    if ds:  # the same latents in FlashMLA's fp8 layout; the bf16 cache then holds their values
        from attn_ops.backends.mla.ds_cache import ds_rows, ds_write

        latent_ds = torch.zeros(blocks, PAGE, 656, dtype=torch.float8_e4m3fn, device="cuda")
        flat, flat_ds = latent.view(-1, 576), latent_ds.view(-1, 656)
        for r0 in range(0, flat.shape[0], 1 << 18):
            r = torch.arange(r0, min(r0 + (1 << 18), flat.shape[0]), device="cuda")
            ds_write(flat[r, :512], flat[r, 512:], latent_ds, r)
            flat[r] = ds_rows(flat_ds[r], 512, BF16, torch.float32).to(BF16)
    keys, scales = allocate_index_cache(blocks, PAGE, INDEX_DIM, FP8, device="cuda")
    keys.copy_(torch.randn(keys.shape, device="cuda").to(FP8))
    scales.uniform_(0.01, 0.1)
    q_idx = torch.randn(t, INDEX_HEADS, INDEX_DIM, device="cuda", dtype=BF16)
    k_idx = torch.randn(t, INDEX_DIM, device="cuda", dtype=BF16)
    weights = torch.randn(t, INDEX_HEADS, device="cuda")
    q = torch.randn(t, HEADS, 192, device="cuda", dtype=BF16)
    kv_c = torch.randn(t, 512, device="cuda", dtype=BF16)
    k_pe = torch.randn(t, 64, device="cuda", dtype=BF16)
    if ds:  # the new tokens' latents at values the fp8 layout holds exactly, like the cache's
        from attn_ops.backends.mla.ds_cache import ds_rows, ds_write

        rows = torch.zeros(t, 1, 656, dtype=torch.float8_e4m3fn, device="cuda")
        ds_write(kv_c, k_pe, rows, torch.arange(t, device="cuda"))
        held = ds_rows(rows.view(t, 656), 512, BF16, torch.float32).to(BF16)
        kv_c, k_pe = held[:, :512].contiguous(), held[:, 512:].contiguous()
    chosen = {}

    def indexer():
        indexer_k_write(k_idx, keys, scales, slot)
        positions = indexer_topk(q_idx, weights, keys, scales, table, seq, qsl, TOPK)
        chosen["slots"] = indexer_slots(positions, table, qsl, PAGE)
        return chosen["slots"]

    indexer()
    slots = chosen["slots"].clone()
    ql_bench = torch.randn(t, HEADS, 512, device="cuda", dtype=BF16)  # (the kernels alone)
    q_pe_bench = torch.randn(t, HEADS, 64, device="cuda", dtype=BF16)
    fns, outputs = {"indexer": indexer}, {}
    for key, layer in layers.items():
        built = layer.impl.build_metadata(common)  # (host planning outside the capture)
        if key.startswith("dense_"):
            fns[key] = lambda layer=layer, built=built: layer(q, kv_c, k_pe, latent, built)
            continue
        name = key[len("sparse_"):]
        cache = latent_ds if key in ds else latent
        fns[f"sparse_attn_{name}"] = (lambda layer=layer, built=built, cache=cache:
                                      layer(q, kv_c, k_pe, cache, built, topk_slots=slots))
        fns[f"sparse_step_{name}"] = (lambda layer=layer, built=built, cache=cache:
                                      layer(q, kv_c, k_pe, cache, built,
                                            topk_slots=indexer()))
        try:
            outputs[name] = fns[f"sparse_attn_{name}"]().float().reshape(t, -1)
        except Exception as e:  # noqa: BLE001 -- recorded again when it is timed
            print(f"sparse_attn_{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if decode and any(n.startswith("FLASHMLA_SPARSE") for n in sparse):
        from attn_ops.backends.mla.common import mla_cache_update

        # (the new tokens' latents in both caches, as the layers and vLLM's step write them)
        for cache in (latent, latent_ds) if latent_ds is not None else (latent,):
            mla_cache_update(kv_c, k_pe, cache, slot, None)
        kernels = flashmla_sparse_kernels(latent, latent_ds, slots, sparse_spec.softmax_scale)
        wkv = w.view(HEADS, 256, 512)
        w_uk, w_uv = wkv[:, :128], wkv[:, 128:].transpose(1, 2)
        for cache_kind, kernel in kernels.items():
            fns[f"kernel_flashmla_sparse_{cache_kind}"] = (
                lambda kernel=kernel: kernel(ql_bench, q_pe_bench))
            fns[f"vllm_flashmla_sparse_{cache_kind}"] = as_vllm(kernel, q, w_uk, w_uv)
            outputs[f"vllm_flashmla_sparse_{cache_kind}"] = \
                fns[f"vllm_flashmla_sparse_{cache_kind}"]().float().reshape(t, -1)
    # the sparse backends (and vLLM's steps) against the first one on the same selection: they
    # must compute the same attention over the same rows for their times to compare
    first = next(iter(outputs.values()), None)
    checks = {n: cross_check(o, first, TOLERANCE) for n, o in outputs.items()}
    return fns, checks


def flashmla_sparse_kernels(latent, latent_ds, slots, scale) -> dict:
    """FlashMLA's sparse kernels alone on ``(ql [T, H, 512], q_pe [T, H, 64])`` as vLLM calls
    them: ``bf16``, the prefill kernel over the bf16 cache (vLLM's path for bf16 latents);
    ``fp8``, the fp8 decode over the fp8_ds_mla cache (where it is built), its tile schedule
    computed by the first call and reused. The slots made -1 outside the cache and padded to
    the kernels' blocks before timing."""
    from attn_ops.providers import FLASHMLA

    _, fm = FLASHMLA.require("bench_mla_sparse")
    capacity = latent.shape[0] * latent.shape[1]
    idx = torch.where((slots >= 0) & (slots < capacity), slots, -1).to(torch.int32)

    def padded(block: int) -> torch.Tensor:
        return torch.nn.functional.pad(idx, (0, -(-idx.shape[1] // block) * block
                                              - idx.shape[1]), value=-1).unsqueeze(1)

    prefill_idx, decode_idx, kv = padded(128), padded(64), latent.view(capacity, 1, 576)
    kernels = {"bf16": lambda ql, q_pe: fm.flash_mla_sparse_fwd(
        q=torch.cat([ql, q_pe], -1), kv=kv, indices=prefill_idx, sm_scale=scale, d_v=512)[0]}
    if latent_ds is not None:
        meta = fm.get_mla_metadata()[0]
        kernels["fp8"] = lambda ql, q_pe: fm.flash_mla_with_kvcache(
            q=torch.cat([ql, q_pe], -1).unsqueeze(1), k_cache=latent_ds.unsqueeze(2),
            block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta,
            num_splits=None, softmax_scale=scale, causal=False, is_fp8_kvcache=True,
            indices=decode_idx)[0][:, 0]
    return kernels


def as_vllm(kernel, q, w_uk, w_uv):
    """A sparse step as vLLM runs it around ``kernel(ql, q_pe) -> [T, H, 512]``: the absorption
    and the value up-projection as torch bmm over the heads (no latent write)."""
    q_nope, q_pe = q[..., :128], q[..., 128:]

    def step():
        ql = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.bmm(kernel(ql, q_pe).transpose(0, 1), w_uv).transpose(0, 1)
    return step


def prefill_rows(n: int, args, gen) -> dict:
    """One request's prefill of ``n`` tokens: sparse step against each dense layer."""
    from triton.testing import do_bench

    fns, checks = case(1, 0, args.sparse, args.dense, gen, new_tokens=n)
    fns = {k: v for k, v in fns.items() if not k.startswith("sparse_attn_")}
    ms, errors = {}, {}
    for name, fn in fns.items():
        try:
            ms[name] = do_bench(fn, rep=100, return_mode="median")
        except Exception as e:  # noqa: BLE001 -- a contender that cannot run here is recorded
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"{name}: {errors[name]}", flush=True)
    counts = torch.arange(1, n + 1).clamp(max=TOPK).sum().item()
    flops = {k: (counts * HEADS * 2 * (576 + 512) if k.startswith("sparse_step_")
                 else n * n / 2 * HEADS * 2 * (192 + 128))
             for k in ms if k.startswith(("sparse_step_", "dense_"))}
    row = {"mode": "prefill", "tokens": n, **{f"{k}_ms": v for k, v in ms.items()},
           "cross_check": checks, "mismatch": [k for k, c in checks.items() if not c["agree"]],
           **{f"{k}_tflops": flops[k] / (v * 1e-3) / 1e12 for k, v in ms.items() if k in flops},
           "errors": errors}
    print(f"prefill {n:<6d} " + "  ".join(
        f"{k} {v:7.3f} ms" + (f" {row[k + '_tflops']:5.0f} TFLOP/s" if k in flops else "")
        for k, v in ms.items()), flush=True)
    return row


def main() -> None:
    parser = gpu_parser(__doc__, "bench_mla_sparse_h200.json", page=PAGE, rounds=1,
                        quick=False)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--ctxs", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--dense", nargs="*",
                        default=["TRITON_MLA", "FLASHINFER_MLA", "COMPOSITE_MLA_SM90"])
    parser.add_argument("--sparse", nargs="+",
                        default=["TRITON_MLA_SPARSE", "FLASHINFER_MLA_SPARSE",
                                 "FLASHMLA_SPARSE", "FLASHMLA_SPARSE:fp8_ds_mla"])
    parser.add_argument("--prefills", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--only", nargs="*", default=["decode", "prefill"])
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in args.prefills if "prefill" in args.only else []:
        rows.append(prefill_rows(n, args, gen))
        write_result("bench_mla_sparse", args.out, quiet=True, rows=rows, complete=False,
                     dense=args.dense)
        torch.cuda.empty_cache()
    for batch in args.batches if "decode" in args.only else []:
        for ctx in args.ctxs:
            fns, checks = case(batch, ctx, args.sparse, args.dense, gen)
            ms, eager, errors = {}, {}, {}
            for name, fn in fns.items():  # (a contender that cannot run here is recorded)
                try:
                    ms.update(time_graph({name: fn}, args.rounds))
                    eager[name] = eager_ms(fn) * 1e3
                except Exception as e:  # noqa: BLE001
                    errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{name}: {errors[name]}", flush=True)
            bad = [k for k, c in checks.items() if not c["agree"]]
            row = {"mode": "decode", "batch": batch, "ctx": ctx,
                   **{f"{n}_us": v * 1e3 for n, v in ms.items()},
                   "eager_us": eager, "cross_check": checks,
                   "mismatch": bad, "errors": errors}
            best_dense = min((v for n, v in ms.items() if n.startswith("dense_")),
                             default=float("nan"))
            step = min((v for n, v in ms.items() if n.startswith("sparse_step_")),
                       default=float("nan"))
            # The dense layers attend to every row, the sparse ones to the selected rows: no
            # output check can hold between them, the ratio is the cost a sparse step saves.
            # It is refused when the sparse backends disagree with each other (one of them
            # computes something else, and the fastest may be that one).
            row["speedup_vs_dense"] = None if bad else best_dense / step
            row["indexer_share"] = ms.get("indexer", float("nan")) / step
            rows.append(row)
            print(f"decode B={batch:<4d} ctx={ctx:<7d} " + "  ".join(
                f"{n} {v * 1e3:8.1f} us" for n, v in ms.items())
                + f"  {ratio_text(row['speedup_vs_dense'])} vs dense, indexer "
                f"{100 * row['indexer_share']:.0f}%, max rel err "
                + " ".join(f"{k} {c['max_rel_err']:.1e}{'' if c['agree'] else ' MISMATCH'}"
                           for k, c in checks.items()), flush=True)
            write_result("bench_mla_sparse", args.out, quiet=True, rows=rows, complete=False,
                         dense=args.dense)
            del fns
            torch.cuda.empty_cache()
    write_result("bench_mla_sparse", args.out, rows=rows, complete=True, dense=args.dense)


if __name__ == "__main__":
    main()
