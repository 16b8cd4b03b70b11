"""TurboQuant KV accuracy, measured: each preset's attention output against unquantized K/V,
beside fp8 e4m3 (a per-tensor scale), on keys with outlier channels as real models' have, and
a small decoder's logits against its run with an unquantized cache.

* ``attention`` -- one decode step of ``--batch`` requests over ``--ctx`` cached tokens, 32
  query / 8 KV heads of ``--head-dim``: keys N(0, 1) with ``--outliers`` channels a head scaled
  by 10, values N(0, 1); through the layer (the write op, then the attention op) in fp32.
  Reported per preset: the keys' inner products with the queries as read back (mean |q.k' -
  q.k| / (|q| |k|)), the output's relative L2 error and SQNR, the cosine of each row (worst),
  the LSE's max abs error, and the KV bytes a token and KV head.
* ``logits`` -- ``attn_ops.models.llama.TinyLlama``-shaped decoder (random weights, ``--layers``
  layers, head dim ``--head-dim``), a ``--prompt``-token prompt prefilled and 16 greedy decode
  steps with the quantized cache against the unquantized one (the same weights): the logits'
  relative L2 error and how many greedy tokens agree. vLLM leaves the first and last two
  layers unquantized (``boundary_layers``); ``--no-boundary`` quantizes every layer.

vLLM's published figures (GSM8K, PPL, MRCR on trained models) are in
``../shared/reference/turboquant_study.md`` section 10; random weights cannot reproduce task
accuracy, so these numbers are the format's error, not a task score.

    python benchmarks/turboquant_accuracy.py [--head-dim 128] [--batch 8] [--ctx 2048]
        [--outliers 4] [--layers 8] [--prompt 256] [--no-boundary] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info, write_json  # noqa: E402

PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def _keys(n, heads, d, outliers, g):
    k = torch.randn(n, heads, d, generator=g)
    for h in range(heads):
        k[:, h, torch.randperm(d, generator=g)[:outliers]] *= 10.0
    return k


def attention_errors(args) -> dict:
    """Each cache dtype's decode output against the unquantized one (same K/V, same query)."""
    from attn_ops import Attention, AttentionSpec, BlockAllocator, build_batch
    from attn_ops.platforms import Platform

    g = torch.Generator().manual_seed(0)
    hq, hk, d = 32, 8, args.head_dim
    n = args.batch * (args.ctx + 1)
    k, v = _keys(n, hk, d, args.outliers, g), torch.randn(n, hk, d, generator=g)
    q = torch.randn(args.batch, hq, d, generator=g)
    rows = [torch.arange(i * (args.ctx + 1), (i + 1) * (args.ctx + 1)) for i in range(args.batch)]

    def run(kv_dtype):
        spec = AttentionSpec(num_heads=hq, num_kv_heads=hk, head_dim=d, dtype=torch.float32,
                             kv_cache_dtype=kv_dtype)
        layer = Attention(spec, platform=Platform.parse("cpu"))
        if kv_dtype == "fp8_e4m3":  # (per-tensor scales from the data's range)
            layer.k_scale.fill_(k.abs().max() / 448)
            layer.v_scale.fill_(v.abs().max() / 448)
        blocks = args.batch * -(-(args.ctx + 1) // layer.block_size) + 1
        alloc = BlockAllocator(blocks, layer.block_size)
        cache = layer.allocate_kv_cache(blocks)
        ids = list(range(args.batch))
        fill = build_batch(alloc, ids, [0] * args.batch, [args.ctx] * args.batch)
        ctx_rows = torch.cat([r[:-1] for r in rows])
        layer(q.new_zeros(fill.slot_mapping.shape[0], hq, d), k[ctx_rows], v[ctx_rows], cache,
              fill)  # (writes the contexts)
        step = build_batch(alloc, ids, [args.ctx] * args.batch, [1] * args.batch)
        last = torch.stack([r[-1] for r in rows])
        return layer(q, k[last], v[last], cache, step, return_lse=True), layer

    (ideal, ideal_lse), _ = run("auto")
    out = {}
    for name in ("fp8_e4m3", *PRESETS):
        (got, lse), layer = run(name)
        inner = _inner_product_error(name, k[:4096], q, d) if name != "fp8_e4m3" else None
        err = ((got - ideal).norm() / ideal.norm()).item()
        cos = torch.nn.functional.cosine_similarity(got.flatten(1), ideal.flatten(1), dim=1)
        slot = layer.allocate_kv_cache(1).numel() / (layer.block_size * hk)
        out[name] = {"inner_product_rel_err": inner,
                     "rel_l2": err, "sqnr_db": -20 * math.log10(err) if err else math.inf,
                     "worst_row_cosine": cos.min().item(),
                     "lse_max_abs_err": (lse - ideal_lse).abs().max().item(),
                     "kv_bytes_per_token_head": slot}
        print(f"attention {name:20s} q.k err {inner or 0:.4f}  rel L2 {err:.4f}  SQNR "
              f"{out[name]['sqnr_db']:5.1f} dB  "
              f"worst row cos {out[name]['worst_row_cosine']:.4f}  LSE err "
              f"{out[name]['lse_max_abs_err']:.4f}  {slot:.0f} B a token and KV head "
              f"({2 * d * 2 / slot:.2f}x fewer than bf16)", flush=True)
    return out


def _inner_product_error(name, keys, queries, d) -> float:
    """Mean ``|q . k' - q . k| / (|q| |k|)`` over ``keys [N, Hk, D]`` read back from their
    slots and each KV head's first query head."""
    from attn_ops.backends.turboquant.format import PRESETS as FORMATS, dequantize_slots, \
        quantize_slots
    from attn_ops.spec import KVCacheDType

    preset = FORMATS[KVCacheDType(name)]
    back, _ = dequantize_slots(quantize_slots(keys, keys, preset), preset, d)
    q = queries[:, ::queries.shape[1] // keys.shape[1]]  # [B, Hk, D]
    exact = torch.einsum("bhd,nhd->bnh", q, keys)
    err = (torch.einsum("bhd,nhd->bnh", q, back) - exact).abs()
    return (err / (q.norm(dim=-1)[:, None] * keys.norm(dim=-1)[None])).mean().item()


def logits_errors(args) -> dict:
    """A random-weight decoder's logits and greedy tokens with each preset's cache against
    its unquantized run."""
    from attn_ops.models.llama import Generator, ModelConfig, TinyLlama
    from attn_ops.platforms import Platform

    g = torch.Generator().manual_seed(1)
    prompt = None

    def run(kv_dtype):
        nonlocal prompt
        cfg = ModelConfig(vocab_size=512, hidden_size=512, num_layers=args.layers, num_heads=8,
                          num_kv_heads=2, head_dim=args.head_dim, intermediate_size=1024,
                          max_position=args.prompt + 32, kv_cache_dtype=kv_dtype,
                          kv_cache_dtype_skip_layers=() if args.no_boundary else None)
        if prompt is None:
            prompt = torch.randint(cfg.vocab_size, (args.prompt,), generator=g).tolist()
        torch.manual_seed(0)
        model = TinyLlama(cfg, platform=Platform.parse("cpu")).eval()
        gen = Generator(model, num_blocks=-(-(args.prompt + 32) // model.block_size) + 4)
        gen.add(0, prompt)
        logits = [gen.step()[0][0] for _ in range(16)]
        return torch.stack(logits), gen.requests[0].generated, sorted(cfg.unquantized_layers)

    ideal, ideal_tokens, _ = run("auto")
    out = {}
    for name in PRESETS:
        got, tokens, keep = run(name)
        err = ((got - ideal).norm() / ideal.norm()).item()
        same = sum(a == b for a, b in zip(tokens, ideal_tokens))
        out[name] = {"logits_rel_l2": err, "greedy_tokens_same": same,
                     "greedy_tokens": len(ideal_tokens)}
        print(f"logits    {name:20s} rel L2 {err:.4f}  greedy tokens equal {same}/"
              f"{len(ideal_tokens)} (boundary layers unquantized: {sorted(keep)})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--outliers", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--no-boundary", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "turboquant_accuracy.json"))
    args = parser.parse_args()
    if args.quick:
        args.batch, args.ctx, args.layers, args.prompt, args.head_dim = 2, 64, 6, 24, 64
    info = run_info("turboquant_accuracy")
    info.update(quick=args.quick, device="cpu", head_dim=args.head_dim, batch=args.batch,
                ctx=args.ctx, outliers=args.outliers, layers=args.layers, prompt=args.prompt,
                boundary_layers_unquantized=not args.no_boundary,
                attention=attention_errors(args), logits=logits_errors(args))
    write_json(args.out, info)


if __name__ == "__main__":
    main()
