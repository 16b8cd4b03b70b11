"""What a request costs in memory on a Qwen3-Next-shaped hybrid model (36 Gated DeltaNet : 12
attention layers; 2 KV heads of 256 in bf16; Qwen3-Next's GDN state), here and under vLLM's
unified page size, by arithmetic (no GPU).

* **here** -- attention pages of the backend's own size (16 tokens: FLASHINFER's and
  COMPOSITE_SM90's decode pages start there), one state slot a request, and with prefix
  caching a state checkpoint at each block boundary a prefill step ends on (one every
  ``--chunk`` tokens of a cached prompt);
* **vLLM** -- one page size for every layer: the attention block is raised until one
  attention page holds one state (``Platform._align_hybrid_block_size``: ``align x
  cdiv(state_page, align x attention_bytes_per_token)``, ``align`` 16), so a request's KV is
  allocated in blocks of that many tokens; each request holds one state page, and with prefix
  caching ("align" mode) one state page per cached block.

Per tensor-parallel rank: ``--tp`` divides the KV heads and the GDN heads alike.

    python benchmarks/hybrid_memory.py [--tp 1 2] [--lens 12 1024 8192] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import math

ATTN_LAYERS, GDN_LAYERS = 12, 36
KV_HEADS, HEAD_DIM, KV_BYTES = 2, 256, 2  # bf16 cache
PAGE = 16  # our attention page (tokens)
VLLM_ALIGN = 16  # vLLM's kernel block alignment for FlashAttention / FlashInfer


def gdn_state_bytes(tp: int, state_bytes: int) -> int:
    """One GDN layer's states of one request on one rank: the conv state ([3, conv_dim] in
    bf16) and the recurrent state ([value heads, 128, 128] in ``state_bytes`` a value)."""
    from attn_ops.backends.ssm.spec import GatedDeltaNetSpec

    spec = GatedDeltaNetSpec(num_k_heads=16 // tp, num_v_heads=32 // tp)
    return (spec.conv_kernel - 1) * spec.conv_dim * 2 \
        + spec.num_v_heads * spec.head_k_dim * spec.head_v_dim * state_bytes


def attention_bytes_per_token(tp: int) -> int:
    """One attention layer's K and V of one token on one rank."""
    return 2 * max(KV_HEADS // tp, 1) * HEAD_DIM * KV_BYTES


def vllm_block_size(state_page: int, token_bytes: int, align: int = VLLM_ALIGN) -> int:
    """vLLM's unified attention block (tokens): the smallest multiple of ``align`` whose
    attention page holds one state page."""
    return align * math.ceil(state_page / (align * token_bytes))


def request_bytes(length: int, tp: int, state_bytes: int, chunk: int, *, vllm: bool,
                  prefix_cached: bool) -> tuple[int, int]:
    """``(KV bytes, state bytes)`` a request of ``length`` tokens holds on one rank across the
    model's layers (``prefix_cached``: its prompt's states kept for later requests too)."""
    token = attention_bytes_per_token(tp)
    state = gdn_state_bytes(tp, state_bytes)
    block = vllm_block_size(state, token) if vllm else PAGE
    kv = ATTN_LAYERS * math.ceil(length / block) * block * token
    if vllm:  # (a state page is padded to the attention page)
        page = block * token
        states = 1 + (length // block if prefix_cached else 0)
        return kv, GDN_LAYERS * states * page
    states = 1 + (length // chunk if prefix_cached else 0)
    return kv, GDN_LAYERS * states * state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--lens", type=int, nargs="+", default=[12, 1024, 8192])
    parser.add_argument("--chunk", type=int, default=2048,
                        help="prefill step length here (a checkpoint at each step's end)")
    args = parser.parse_args()
    mib = 1 << 20
    print("| TP | state dtype | vLLM attention block (tokens) | ours | tokens | KV MiB ours / "
          "vLLM | states MiB ours / vLLM | with prefix caching: states MiB ours / vLLM |")
    print("|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        for name, sb in (("fp32", 4), ("bf16", 2)):
            block = vllm_block_size(gdn_state_bytes(tp, sb), attention_bytes_per_token(tp))
            for n in args.lens:
                ours = request_bytes(n, tp, sb, args.chunk, vllm=False, prefix_cached=False)
                theirs = request_bytes(n, tp, sb, args.chunk, vllm=True, prefix_cached=False)
                ours_p = request_bytes(n, tp, sb, args.chunk, vllm=False, prefix_cached=True)
                theirs_p = request_bytes(n, tp, sb, args.chunk, vllm=True, prefix_cached=True)
                print(f"| {tp} | {name} | {block} | {PAGE} | {n} | {ours[0] / mib:.2f} / "
                      f"{theirs[0] / mib:.2f} | {ours[1] / mib:.1f} / {theirs[1] / mib:.1f} | "
                      f"{ours_p[1] / mib:.1f} / {theirs_p[1] / mib:.1f} |")


if __name__ == "__main__":
    main()
