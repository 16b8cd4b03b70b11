"""A hybrid model's decode step: attention between Gated DeltaNet layers (Qwen3-Next-like
shapes, 3 GDN : 1 attention), eager, compiled and compiled + CUDA-graphed, against its bytes
floor and HF transformers' Qwen3NextForCausalLM of the same shape in the same run.

Shapes: hidden 2048; attention 16 query / 2 KV heads of 256 (paged, bf16); GDN 16 key / 32
value heads of 128, conv 4, fp32 states; dense MLP 5120 (no MoE); vocab 151936; ``--layers``
8, ``--batch`` 64 requests of ``--ctx`` 4096 cached tokens, one new token each. Floor: weights
+ the KV cache read once + every state read and written once, at 4.27 TB/s.

HF's model is a cost reference of the same shapes, not the same computation: Qwen3-Next's
attention layers gate their output and normalize q / k, its norms are zero-centred, and ours
are Llama's, so no output check can hold between the two and no ratio to it is printed or
recorded (``hf["cross_check"]`` says so). The GDN layers alone are checked against HF's
modules in ``tests/test_ssm.py``, and bench_ssm.py checks the recurrences against fla.

    python benchmarks/bench_hybrid_decode.py [--layers 8] [--batch 64] [--ctx 4096]
        [--steps 20] [--quick] [--no-hf] [--out PATH]

``--quick``: CPU, tiny shapes, eager and compiled only (keeps the script working in CI).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (back_to_back_us, decode_step_device, decode_step_parser,  # noqa: E402
                     run_info, time_steps, write_json)

COPY_TBS = 4.27
PREFILL_CHUNK = 256  # the HF anchor's cache-filling prefill, tokens a call


def config(args, dtype):
    from attn_ops.backends.ssm.spec import GatedDeltaNetSpec
    from attn_ops.models.hybrid import HybridConfig

    if args.quick:
        return HybridConfig(vocab_size=128, hidden_size=64, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=16, intermediate_size=128, dtype=dtype,
                            max_position=args.ctx + 8,
                            gdn=GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                                  head_v_dim=16, dtype=dtype))
    return HybridConfig(vocab_size=151936, hidden_size=2048, num_layers=args.layers,
                        num_heads=16, num_kv_heads=2, head_dim=256, intermediate_size=5120,
                        dtype=dtype, max_position=args.ctx + 8,
                        gdn=GatedDeltaNetSpec(num_k_heads=16, num_v_heads=32, head_k_dim=128,
                                              head_v_dim=128, dtype=dtype))


def ours(cfg, args, device) -> dict:
    from attn_ops import AttentionConfig, build_batch, build_step_metadata, step_backends
    from attn_ops.backends.ssm.metadata import build_state_metadata
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.models.hybrid import HybridGraphRunner, HybridModel
    from attn_ops.kv_cache import BlockAllocator

    torch.manual_seed(0)
    backend = "CPU_ATTN" if device == "cpu" else args.backend
    with torch.device(device):
        model = HybridModel(cfg, AttentionConfig(backend=backend)).to(cfg.dtype).eval()
    block = model.block_size
    max_blocks = -(-(args.ctx + 1) // block)
    alloc = BlockAllocator(args.batch * max_blocks + 1, block, shuffle=True,
                           num_state_slots=args.batch)
    for r in range(args.batch):
        alloc.reserve(r, args.ctx)
    caches = model.allocate_kv_caches(alloc.num_blocks, device)
    states = model.allocate_states(args.batch, device)
    for t in [*caches, *(s for st in states for s in st if s is not None)]:
        t.normal_().mul_(0.1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch,), device=device)
    reqs = list(range(args.batch))
    backends = step_backends(model)

    def metas():
        common = build_batch(alloc, reqs, [args.ctx - 1] * args.batch, [1] * args.batch,
                             device=device, max_blocks_per_req=max_blocks)
        state = build_state_metadata(common.query_start_loc_cpu,
                                     np.full(args.batch, args.ctx - 1), alloc.state_slots(reqs),
                                     cfg.state_spec.chunk_size, device=device)
        return common, state

    def step(forward):
        common, state = metas()
        return forward(ids, common.positions, caches, states,
                       build_step_metadata(backends, common), state)

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    n_attn, n_rec = len(model.attention_layers), len(model.recurrent_layers)
    kv = (args.batch * args.ctx * n_attn * cfg.num_kv_heads * cfg.head_dim * 2
          * caches[0].element_size())
    state_bytes = args.batch * n_rec * cfg.state_spec.state_bytes() * 2
    row = {"backend": backend, "weights_bytes": weights, "kv_bytes": kv,
           "state_bytes_read_and_written": state_bytes,
           "floor_ms": (weights + kv + state_bytes) / COPY_TBS / 1e9}
    with torch.no_grad():
        row["eager_ms"] = time_steps(lambda: step(model), args.steps, device)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        row["compiled_ms"] = time_steps(lambda: step(compiled), args.steps, device)
        if device == "cuda":
            graphs = CUDAGraphBatch((args.batch,), max_blocks, block, device)
            runner = HybridGraphRunner(model, compiled, graphs, caches, states)

            def graphed():
                common, state = metas()
                return runner(ids, common, state)

            row["graphed_ms"] = time_steps(graphed, args.steps, device)
            row["graphed_pipelined_ms"] = back_to_back_us(graphed, args.steps, 1) / 1e3
            graph, _ = runner.captured[args.batch]
            row["replay_only_ms"] = time_steps(graph.replay, args.steps, device)
            row["host_prep_ms"] = time_steps(metas, args.steps, "cpu")
            row["fraction_of_floor"] = row["floor_ms"] / min(row["graphed_ms"],
                                                            row["graphed_pipelined_ms"])
    return row


def hf(cfg, args, device) -> dict:
    """HF's Qwen3NextForCausalLM of the same shape (dense MLPs), its cache filled with
    ``ctx - 1`` random tokens a request by prefills of ``PREFILL_CHUNK`` tokens (logits of the
    last position only; one prefill of the whole context needs a batch x heads x ctx x ctx
    attention mask, past 32-bit indexing); then decode steps (eager)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    s = cfg.state_spec
    layer_types = ["full_attention" if cfg.is_attention(i) else "linear_attention"
                   for i in range(cfg.num_layers)]
    hf_cfg = Qwen3NextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, linear_num_key_heads=s.num_k_heads,
        linear_num_value_heads=s.num_v_heads, linear_key_head_dim=s.head_k_dim,
        linear_value_head_dim=s.head_v_dim, linear_conv_kernel_dim=s.conv_kernel,
        layer_types=layer_types, mlp_only_layers=list(range(cfg.num_layers)),
        max_position_embeddings=args.ctx + 64, torch_dtype=cfg.dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3NextForCausalLM(hf_cfg).to(cfg.dtype).eval()
    out = {}
    with torch.no_grad():
        try:
            prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.ctx - 1), device=device)
            cache = None
            for first in range(0, args.ctx - 1, PREFILL_CHUNK):
                cache = model(input_ids=prompt[:, first:first + PREFILL_CHUNK],
                              past_key_values=cache, use_cache=True,
                              logits_to_keep=1).past_key_values
            ids = torch.randint(0, cfg.vocab_size, (args.batch, 1), device=device)
            out["eager_dynamic_cache_ms"] = time_steps(
                lambda: model(input_ids=ids, past_key_values=cache, use_cache=True),
                args.steps, device)
        except Exception as e:  # noqa: BLE001 -- an anchor that fails is a result too
            out["eager_dynamic_cache_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def main() -> None:
    parser = decode_step_parser(__doc__, 4096, "bench_hybrid_decode.json")
    parser.add_argument("--backend", default="TRITON_ATTN",
                        help="the attention layers' backend on the GPU")
    args = parser.parse_args()
    device, dtype = decode_step_device(args)
    cfg = config(args, dtype)
    row = ours(cfg, args, device)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    anchor = hf(cfg, args, device) if device == "cuda" and not args.no_hf else {}
    if anchor:
        anchor["cross_check"] = ("none: Qwen3NextForCausalLM computes another model (gated, "
                                 "q/k-normed attention, zero-centred norms); a cost reference "
                                 "of the same shapes, no ratio")
    print({"hf": anchor}, flush=True)
    info = run_info("bench_hybrid_decode")
    info.update(quick=args.quick, device=torch.cuda.get_device_name() if device == "cuda"
                else "cpu", layers=cfg.num_layers, batch=args.batch, ctx=args.ctx,
                dtype=str(dtype), rows=[row], hf=anchor)
    write_json(args.out, info)


if __name__ == "__main__":
    main()
