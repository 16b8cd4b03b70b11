"""DeepSeek-V4's KV-cache bytes for one long request, per layer kind, from the formats'
arithmetic, beside DeepSeek-V3.2's (MLA + its indexer on every layer).

Per layer of V4-Flash (43 layers: 2 sliding-window-only, then compressed-sparse (ratio 4) and
heavily compressed (ratio 128) alternating, 21 and 20 of them):

* window: the last 128 tokens' 584-byte entries (every layer), and rounded up to whole pages
  of 64 tokens plus the one a moving window straddles;
* C4A: ``ctx / 4`` compressed 584-byte entries; its indexer: ``ctx / 4`` keys of 132 bytes
  (128 e4m3 + an fp32 scale); C128A: ``ctx / 128`` entries;
* the compressors' states (fp32 rows ``[c | z + B]`` of the tokens a later entry reads):
  C4 main 8 x 2 x 2 x 512 x 4, C4 indexer 8 x 2 x 2 x 128 x 4, C128 128 x 2 x 512 x 4 bytes.

V3.2 (61 layers): every token's 656-byte ``fp8_ds_mla`` latent and 132-byte indexer key in
every layer. vLLM's V4 report: 8.7x less KV than V3.2 (``deepseek_v4_study.md``).

The pool column is what ``DeepseekV4CachePool`` holds for the request: whole 37,376-byte pages
(64 window tokens, 64 compressed entries or 283 index keys a page) after the window pages
behind the window are released -- its overhead over the exact bytes is the last partial page
of each cache and the window's pages. The vLLM column uses vLLM 0.26's padded page sizes and
entries a block (window 64 tokens and C4A 64 entries in 37,440 bytes, C4 index 64 keys in
8,640, C128A 2 entries in 1,728; study section 5), with the window held as ours.

    python benchmarks/dsv4_memory.py [--ctx 1048576] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run_info, write_json  # noqa: E402

ENTRY, INDEX_KEY, V32_LATENT = 584, 132, 656
WINDOW, WINDOW_PAGE = 128, 64
LAYERS = {"swa_only": 2, "c4a": 21, "c128a": 20}  # V4-Flash's 43
V32_LAYERS = 61


def layer_bytes(kind: str, ctx: int, paged_window: bool = False) -> dict[str, int]:
    """One layer's cache bytes for a request of ``ctx`` tokens, by part."""
    window = min(ctx, WINDOW)
    if paged_window:  # (whole pages, plus the one a moving window straddles)
        window = min(ctx, (-(-WINDOW // WINDOW_PAGE) + 1) * WINDOW_PAGE)
    parts = {"window": window * ENTRY}
    if kind == "c4a":
        parts.update(compressed=ctx // 4 * ENTRY, indexer_keys=ctx // 4 * INDEX_KEY,
                     states=8 * 2 * 2 * 512 * 4 + 8 * 2 * 2 * 128 * 4)
    elif kind == "c128a":
        parts.update(compressed=ctx // 128 * ENTRY, states=128 * 2 * 512 * 4)
    return parts


def pool_layer_bytes(kind: str, ctx: int) -> dict[str, int]:
    """One layer's bytes in ``DeepseekV4CachePool`` pages, by cache (the pool's own rule)."""
    import torch

    from attn_ops.backends.deepseek_v4.pool import DeepseekV4CachePool
    from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec

    spec = {"swa_only": DeepseekV4Spec("sliding_attention", kv_cache_dtype="fp8_ds_mla"),
            "c4a": DeepseekV4Spec("compressed_sparse_attention", compress_ratio=4,
                                  index_heads=64, index_head_dim=128, index_topk=512,
                                  kv_cache_dtype="fp8_ds_mla"),
            "c128a": DeepseekV4Spec("heavily_compressed_attention", compress_ratio=128,
                                    kv_cache_dtype="fp8_ds_mla")}[kind]
    pool = DeepseekV4CachePool([spec], 1, window_page=WINDOW_PAGE, device=torch.device("meta"))
    pages = pool.pages_needed(spec, ctx)
    pages["window"] = min(pages["window"], -(-WINDOW // WINDOW_PAGE) + 1)  # (after releases)
    return {cache: n * pool.page_bytes for cache, n in pages.items()}


def vllm_layer_bytes(kind: str, ctx: int) -> dict[str, int]:
    """One layer's bytes in vLLM's padded pages (its entries a block), the window as ours."""
    window = (-(-WINDOW // WINDOW_PAGE) + 1) * 37_440
    if kind == "c4a":
        return {"window": window, "compressed": -(-(ctx // 4) // 64) * 37_440,
                "index": -(-(ctx // 4) // 64) * 8_640}
    if kind == "c128a":
        return {"window": window, "compressed": -(-(ctx // 128) // 2) * 1_728}
    return {"window": window}


def v32_layer_bytes(ctx: int) -> int:
    return ctx * (V32_LATENT + INDEX_KEY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=1 << 20)
    parser.add_argument("--quick", action="store_true", help="(the same arithmetic; CI)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "dsv4_memory.json"))
    args = parser.parse_args()
    rows, total = {}, {"exact": 0, "paged": 0, "pool": 0, "vllm": 0}
    for kind, count in LAYERS.items():
        exact, paged = layer_bytes(kind, args.ctx), layer_bytes(kind, args.ctx, True)
        pool, vllm = pool_layer_bytes(kind, args.ctx), vllm_layer_bytes(kind, args.ctx)
        rows[kind] = {"layers": count, "bytes_per_layer": exact,
                      "bytes_per_layer_paged_window": paged, "bytes_per_layer_pool": pool,
                      "bytes_per_layer_vllm_pages": vllm}
        total["exact"] += count * sum(exact.values())
        total["paged"] += count * sum(paged.values())
        cache_bytes = sum(v for k, v in exact.items() if k != "states")
        total["pool"] += count * sum(pool.values())
        total["vllm"] += count * sum(vllm.values())
        print(f"{kind:9s} x{count:2d}: " + ", ".join(f"{k} {v / 2**20:9.2f} MiB"
                                                   for k, v in exact.items())
              + f"  = {sum(exact.values()) / 2**20:9.2f} MiB a layer", flush=True)
        print(f"{'':14s}pages: pool {sum(pool.values()) / 2**20:9.2f} MiB "
              f"({sum(pool.values()) / max(cache_bytes, 1) - 1:+.2%} over the exact caches), "
              f"vLLM's {sum(vllm.values()) / 2**20:9.2f} MiB "
              f"({sum(vllm.values()) / max(cache_bytes, 1) - 1:+.2%})", flush=True)
    v32 = V32_LAYERS * v32_layer_bytes(args.ctx)
    ratio = v32 / total["exact"]
    print(f"V4-Flash {total['exact'] / 2**30:.2f} GiB ({total['paged'] / 2**30:.2f} with paged "
          f"windows) for {args.ctx} tokens; V3.2 {v32 / 2**30:.2f} GiB: {ratio:.1f}x less "
          f"(vLLM reports 8.7x)", flush=True)
    info = run_info("dsv4_memory")
    print(f"pool pages {total['pool'] / 2**30:.2f} GiB, vLLM's pages {total['vllm'] / 2**30:.2f} "
          "GiB (caches only; the states are slots)", flush=True)
    info.update(quick=args.quick, ctx=args.ctx, layers=rows, total_bytes=total["exact"],
                total_bytes_paged_window=total["paged"], total_bytes_pool=total["pool"],
                total_bytes_vllm_pages=total["vllm"], v32_bytes=v32, ratio_vs_v32=ratio)
    write_json(args.out, info)


if __name__ == "__main__":
    main()
