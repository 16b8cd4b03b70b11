"""One decode step of a Llama-3-8B-shaped decoder: eager, ``torch.compile`` (whole
model, ``fullgraph=True``, without and with our fusion passes) and compiled + CUDA graph, for
each GPU attention backend (default: COMPOSITE_SM90, FLASHINFER, TRITON_ATTN), next to HF
transformers' own ``LlamaForCausalLM`` of the same shape in the same run (eager, SDPA, dynamic
cache).

Shapes: 8 layers, hidden 4096, 32 query / 8 KV heads, head dim 128, MLP 14336, vocab
32000, bf16, batch 64, context 2k, random weights. Floor: weights + KV cache read once at the
device's copy bandwidth (4.27 TB/s on the H200: about 1.9 ms). Times are medians of CUDA-event
timed steps, each synchronized: every step rebuilds the batch and step metadata on the host
(planning included), as an engine would; in graph mode :func:`attn_ops.build_step_metadata`
writes the graphs' persistent buffers and the captured graph replays. Graph mode also reports
the same steps back to back (``graphed_pipelined_ms``: the host prepares a step while the GPU
runs the last, as with asynchronous scheduling), the host's share alone (``host_prep_ms``; its
parts in ``host_prep_parts_ms``), a replay alone (``replay_only_ms``) and the kernels with the
most time in it. Kernels per layer per step, with and without the passes: all the profiler's
CUDA kernels in one compiled step, and those launched inside ``attn::`` ops (attention and its
glue).

    python benchmarks/bench_model_decode.py [--backends A B ..] [--layers 8] [--batch 64]
        [--ctx 2048] [--steps 20] [--quick] [--mla] [--out PATH]

A backend ``auto`` runs the model with each layer's backend left to the selector; a backend
``TURBOQUANT:<preset>`` (e.g. ``TURBOQUANT:turboquant_4bit_nc``) runs the model with
that TurboQuant cache: its layers select TURBOQUANT and vLLM's boundary layers (the first and
last two) an unquantized cache with the backend auto-selected, all at pages of 16; the floor
counts each layer's bytes a token (run it with ``--no-hf``: HF's model has no such cache).

``--mla``: a DeepSeek-V2-Lite-shaped decoder instead (16 heads, latent 512 + 64, QK 192 /
V 128, dense MLP 10944, vocab 102400; run it with ``--ctx 4096``), TRITON_MLA and
FLASHINFER_MLA, against HF's ``DeepseekV3ForCausalLM`` of the same shape.

Before timing, each backend's model takes the HF model's weights and both run the same prompt
(a prefill of 2 x 16 tokens, then one decode step; ``hf_cross_check``): their last-token logits
must agree (``HF_TOL``), else HF's step time is reported as "mismatch" -- it would be of
another computation -- and the plot leaves it out. ``--no-hf`` skips HF altogether.

``--quick``: CPU, tiny shapes, eager and compiled only, the HF cross-check included (keeps the
script and its weight mapping working in CI).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (back_to_back_us, check_text, cross_check,  # noqa: E402
                     decode_step_device, decode_step_parser, run_info, time_steps, write_json)

COPY_TBS = 4.27  # H200 device-to-device copy bandwidth (../shared/gpu/README.md)


def model_config(args, dtype):
    from attn_ops.models.llama import ModelConfig

    if args.mla:  # DeepSeek-V2-Lite's attention and dense MLP (its first layer's), no MoE
        from attn_ops.models.deepseek import MLAModelConfig

        if args.quick:
            return MLAModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                  v_head_dim=16, intermediate_size=128, dtype=dtype,
                                  max_position=args.ctx + 8)
        return MLAModelConfig(vocab_size=102400, hidden_size=2048, num_layers=args.layers,
                              num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944,
                              dtype=dtype, max_position=args.ctx + 8)
    if args.quick:
        return ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, intermediate_size=128, dtype=dtype,
                           max_position=args.ctx + 8)
    return ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=args.layers,
                       num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                       dtype=dtype, max_position=args.ctx + 8)


def _fill_turboquant(cache, cfg, device) -> None:
    """Every slot of a TurboQuant cache holding random K/V (its write op, in chunks)."""
    from attn_ops.backends.turboquant.ops import turboquant_cache_update

    slots = cache.shape[0] * cache.shape[2]
    for start in range(0, slots, 1 << 16):
        n = min(1 << 16, slots - start)
        k, v = (torch.randn(n, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=cfg.dtype)
                for _ in range(2))
        turboquant_cache_update(k, v, cache, torch.arange(start, start + n, device=device),
                                cfg.kv_cache_dtype)


class Engine:
    """Our model with paged caches holding ``batch`` requests of ``ctx - 1`` cached tokens;
    ``step()`` builds the metadata of one decode step (one new token per request)."""

    def __init__(self, cfg, backend, batch, ctx, device):
        from attn_ops import AttentionConfig
        from attn_ops.kv_cache import BlockAllocator
        from attn_ops.models.deepseek import MLAModelConfig, TinyDeepseek
        from attn_ops.models.llama import TinyLlama

        torch.manual_seed(0)
        model_cls = TinyDeepseek if isinstance(cfg, MLAModelConfig) else TinyLlama
        backend, _, kv_dtype = backend.partition(":")  # ("TURBOQUANT:<preset>": its layers)
        if kv_dtype:  # (TurboQuant layers select TURBOQUANT; vLLM's boundary layers, auto)
            cfg = dataclasses.replace(cfg, kv_cache_dtype=kv_dtype, block_size=16)
            backend = None
        elif backend == "auto":  # (the selector's choice on this machine)
            backend = None
        with torch.device(device):  # (initializing 2B parameters on the host takes minutes)
            self.model = model_cls(cfg, AttentionConfig(backend=backend)).to(cfg.dtype)
        self.model.eval()
        from attn_ops import step_backends

        self.backends = step_backends(self.model)  # (built once, as an engine would)
        self.batch, self.ctx, self.device = batch, ctx, device
        block = self.model.block_size
        self.max_blocks = -(-(ctx + 1) // block)
        self.allocator = BlockAllocator(batch * self.max_blocks + 1, block, shuffle=True)
        for r in range(batch):
            self.allocator.reserve(r, ctx)
        self.caches = self.model.allocate_kv_caches(self.allocator.num_blocks, device)
        for cache in self.caches:  # random context (the attention reads all of it)
            if cache.dtype == torch.uint8:  # (TurboQuant slots: random K/V written)
                _fill_turboquant(cache, cfg, device)
            else:
                cache.normal_()
        self.ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)

    def common(self):
        from attn_ops.metadata import build_batch

        return build_batch(self.allocator, list(range(self.batch)), [self.ctx - 1] * self.batch,
                           [1] * self.batch, device=self.device,
                           max_blocks_per_req=self.max_blocks)

    def eager_step(self, forward):
        from attn_ops import build_step_metadata

        common = self.common()
        return forward(self.ids, common.positions, self.caches,
                       build_step_metadata(self.backends, common))


def kernel_counts(fn, layers) -> dict:
    """CUDA kernels the profiler sees in one call of ``fn`` (a compiled step, not graphed), per
    layer: all of them (GEMMs, norms, ...), and those launched inside ``attn::`` ops --
    attention and its glue (RoPE, slot mapping, KV-cache write), which the passes fuse."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]

    def launched(e):  # kernels launched by a CPU op and the ops it called
        return sum(1 for k in e.kernels if not k.name.startswith(("Memcpy", "Memset"))) + \
            sum(launched(c) for c in e.cpu_children)

    def outermost_attn(e):
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("attn::"):
                return False
            parent = parent.cpu_parent
        return True

    attn_ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
                and e.name.startswith("attn::") and outermost_attn(e)]
    return {"all": len(kernels) / layers,
            "attention_and_glue": sum(launched(e) for e in attn_ops) / layers,
            "attn_ops": sorted({e.name for e in attn_ops})}


def top_kernels(fn, n=10) -> list:
    """The ``n`` kernels with the most GPU time in one call of ``fn``: ``[name, calls, total
    us]``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            calls, us = totals.get(e.name, (0, 0.0))
            totals[e.name] = (calls + 1, us + e.device_time)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [[name[:90], calls, round(us, 1)] for name, (calls, us) in ranked]


def hf_deepseek(cfg, ctx, device):
    """HF's DeepseekV3ForCausalLM with our shapes (dense MLPs, random weights)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, first_k_dense_replace=cfg.num_layers,
        max_position_embeddings=ctx + 8, torch_dtype=cfg.dtype, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return DeepseekV3ForCausalLM(hf_cfg).to(cfg.dtype).eval()


def random_cache(model, batch: int, tokens: int, device):
    """A DynamicCache of ``tokens`` random entries per request, in whatever layout ``model``'s
    transformers release caches (up-projected K/V per head, or DeepSeek's latent rows): one
    probe step shows the shapes, then random tensors of that shape fill a fresh cache."""
    from transformers import DynamicCache

    probe = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device),
              past_key_values=probe, use_cache=True)
    cache = DynamicCache()
    for i, layer in enumerate(probe.layers):
        k, v = layer.keys, layer.values
        cache.update(torch.randn(*k.shape[:2], tokens, k.shape[3], dtype=k.dtype, device=device),
                     torch.randn(*v.shape[:2], tokens, v.shape[3], dtype=v.dtype, device=device),
                     i)
    return cache


def hf_model(cfg, ctx, device):
    """HF's LlamaForCausalLM (DeepseekV3ForCausalLM for an MLA config) with our shapes
    (random weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attn_ops.models.deepseek import MLAModelConfig

    if isinstance(cfg, MLAModelConfig):
        return hf_deepseek(cfg, ctx, device)

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         max_position_embeddings=ctx + 8, torch_dtype=cfg.dtype,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(hf_cfg).to(cfg.dtype).eval()


def load_hf_llama(model, hf) -> None:
    """Copy ``transformers``' ``LlamaForCausalLM`` ``hf`` into our TinyLlama ``model`` of the
    same shapes (q / k / v into the fused ``qkv_proj``, gate / up into ``gate_up``)."""
    model.embed.weight.copy_(hf.model.embed_tokens.weight)
    model.norm.weight.copy_(hf.model.norm.weight)
    model.lm_head.weight.copy_(hf.lm_head.weight)
    for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
        a, mlp = theirs.self_attn, theirs.mlp
        ours.input_norm.weight.copy_(theirs.input_layernorm.weight)
        ours.post_norm.weight.copy_(theirs.post_attention_layernorm.weight)
        ours.qkv_proj.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight,
                                              a.v_proj.weight]))
        ours.o_proj.weight.copy_(a.o_proj.weight)
        ours.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        ours.down.weight.copy_(mlp.down_proj.weight)


# The HF cross-check's prompt (requests, tokens), and the largest max |ours - HF| / max |HF| of
# its last-token logits: fp32 differs by summation order; bf16 rounds every layer's
# activations (and HF its cos / sin) on both sides in different places, a few ulps through
# the layers. A missing mask, RoPE or cache write is off by O(1).
HF_PROMPT = (2, 16)
HF_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def hf_cross_check(model, hf, device) -> dict:
    """Our model with ``hf``'s weights loaded against ``hf`` on the same prompt, in the same
    run: the last-token logits of a prefill of ``HF_PROMPT`` random tokens (fresh caches on
    both sides) and of one decode step after it (:func:`_common.cross_check`, ``HF_TOL``).
    The anchor's times are of the same computation only where this agrees."""
    from transformers import DynamicCache

    from attn_ops import build_step_metadata, step_backends
    from attn_ops.kv_cache import BlockAllocator
    from attn_ops.metadata import build_batch
    from attn_ops.models.deepseek import TinyDeepseek, load_hf_deepseek

    (load_hf_deepseek if isinstance(model, TinyDeepseek) else load_hf_llama)(model, hf)
    n, t = HF_PROMPT
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randint(0, hf.config.vocab_size, (n, t), generator=gen).to(device),
             torch.randint(0, hf.config.vocab_size, (n, 1), generator=gen).to(device)]
    block = model.block_size
    alloc = BlockAllocator(n * -(-(t + 1) // block) + 1, block, shuffle=True)
    caches = model.allocate_kv_caches(alloc.num_blocks, device)
    backends, reqs = step_backends(model), list(range(n))
    ours, theirs, cache = {}, {}, DynamicCache()
    for name, ctx, ids in (("prefill", 0, steps[0]), ("decode", t, steps[1])):
        common = build_batch(alloc, reqs, [ctx] * n, [ids.shape[1]] * n, device=device)
        logits = model(ids.reshape(-1), common.positions, caches,
                       build_step_metadata(backends, common))
        ours[name] = logits.view(n, ids.shape[1], -1)[:, -1].float()
        theirs[name] = hf(input_ids=ids, past_key_values=cache,
                          use_cache=True).logits[:, -1].float()
    tol = HF_TOL.get(next(hf.parameters()).dtype, HF_TOL[torch.bfloat16])
    return cross_check(ours, theirs, {"prefill": tol, "decode": tol})


def measure_backend(cfg, backend, args, device, manager, hf=None) -> dict:
    """Eager, compiled without and with our passes, and (GPU) compiled + CUDA graph; first,
    with ``hf`` (HF's model of the same shapes), our model takes its weights and is
    cross-checked against it (``hf_cross_check``)."""
    import torch._inductor.config as inductor_config

    engine = Engine(cfg, backend, args.batch, args.ctx, device)
    check = None
    if hf is not None:
        with torch.no_grad():
            check = hf_cross_check(engine.model, hf, device)
        print(f"{backend} against HF: {check_text(check)}", flush=True)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    # K and V (MLA: the latent row) of every context token, once
    row_elems = cfg.kv_lora_rank + cfg.qk_rope_head_dim if args.mla else \
        cfg.num_kv_heads * cfg.head_dim * 2
    kv = args.batch * args.ctx * sum(  # (each layer's bytes a token: TurboQuant's slots)
        c[0].numel() * c.element_size() / engine.model.block_size for c in engine.caches) \
        if not args.mla else \
        args.batch * args.ctx * cfg.num_layers * row_elems * engine.caches[0].element_size()
    row = {"backend": backend, "weights_bytes": weights, "kv_bytes": kv,
           "floor_ms": (weights + kv) / COPY_TBS / 1e9, "hf_cross_check": check}
    with torch.no_grad():
        row["eager_ms"] = time_steps(lambda: engine.eager_step(engine.model), args.steps,
                                     device)
        if device == "cuda":
            row["eager_top_kernels"] = top_kernels(lambda: engine.eager_step(engine.model))
        for label, passes in (("_no_passes", None), ("", manager)):
            with inductor_config.patch(post_grad_custom_post_pass=passes):
                torch._dynamo.reset()
                compiled = torch.compile(engine.model, fullgraph=True)
                row[f"compiled{label}_ms"] = time_steps(
                    lambda: engine.eager_step(compiled), args.steps, device)
                if device == "cuda":
                    counts = kernel_counts(lambda: engine.eager_step(compiled), cfg.num_layers)
                    row[f"kernels_per_layer{label}"] = counts["all"]
                    row[f"attention_kernels_per_layer{label}"] = counts["attention_and_glue"]
                    row[f"attn_ops{label}"] = counts["attn_ops"]
                    row[f"compiled{label}_top_kernels"] = top_kernels(
                        lambda: engine.eager_step(compiled))
        if device == "cuda":
            from attn_ops import build_step_metadata
            from attn_ops.cudagraph import CUDAGraphBatch, CUDAGraphRunner

            graphs = CUDAGraphBatch((engine.batch,), engine.max_blocks, engine.model.block_size,
                                    device)
            runner = CUDAGraphRunner(engine.model, compiled, graphs, engine.caches)

            def graphed_step():
                return runner(engine.ids, engine.common())

            row["graphed_ms"] = time_steps(graphed_step, args.steps, device)
            # back to back: the host prepares a step while the GPU runs the last, as an engine
            # with asynchronous scheduling does
            row["graphed_pipelined_ms"] = back_to_back_us(graphed_step, args.steps, 1) / 1e3
            row["host_prep_ms"] = time_steps(  # the host's share: batch + graph metadata
                lambda: build_step_metadata(engine.backends, engine.common(), graphs), args.steps,
                "cpu")
            common = engine.common()
            row["host_prep_parts_ms"] = {  # the batch; its padding (+ the backends' metadata)
                "build_batch": time_steps(engine.common, args.steps, "cpu"),
                "pad": time_steps(lambda: graphs.pad(common), args.steps, "cpu"),
                "pad_and_graph_metadata": time_steps(
                    lambda: build_step_metadata(engine.backends, common, graphs), args.steps,
                    "cpu")}
            graph, _ = runner.captured[engine.batch]
            row["replay_only_ms"] = time_steps(graph.replay, args.steps, device)
            row["top_kernels"] = top_kernels(graph.replay)
            row["fraction_of_floor"] = row["floor_ms"] / min(row["graphed_ms"],
                                                            row["graphed_pipelined_ms"])
    return row


def main() -> None:
    parser = decode_step_parser(__doc__, 2048, "bench_model_decode.json")
    parser.add_argument("--backends", nargs="*", default=None)
    parser.add_argument("--mla", action="store_true",
                        help="a DeepSeek-V2-Lite-shaped MLA decoder (16 heads, latent 512 + 64,"
                             " dense MLP 10944) against HF's DeepseekV3ForCausalLM")
    args = parser.parse_args()
    from attn_ops import compile_passes

    device, dtype = decode_step_device(args)
    cfg = model_config(args, dtype)
    hf_anchor, hf = None, {}
    if not args.no_hf:  # (built first: our models take its weights for the cross-check)
        try:
            hf_anchor = hf_model(cfg, args.ctx, device)
        except Exception as e:  # noqa: BLE001 -- recorded: an anchor that fails is a result
            hf["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if args.mla and hf_anchor is not None:  # (our RoPE must be the HF config's)
            from attn_ops.models.deepseek import hf_rope_config

            cfg = dataclasses.replace(cfg, **hf_rope_config(hf_anchor.config))
    if args.mla:
        backends = args.backends or (["REFERENCE_MLA"] if device == "cpu"
                                     else ["COMPOSITE_MLA_SM90", "FLASHINFER_MLA",
                                           "TRITON_MLA"])
    else:
        backends = args.backends or (["CPU_ATTN"] if device == "cpu"
                                     else ["COMPOSITE_SM90", "FLASHINFER", "TRITON_ATTN"])
    manager = compile_passes.install()
    rows = []
    for backend in backends:  # (each measured in a function: its models and graphs go with it)
        row = measure_backend(cfg, backend, args, device, manager, hf_anchor)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        rows.append(row)
    if rows and hf_anchor is not None:
        # HF's step time means something beside ours only where every backend agreed with it
        hf["cross_check"] = {r["backend"]: r["hf_cross_check"] for r in rows}
        hf["agree"] = all(c["agree"] for c in hf["cross_check"].values())
        if not hf["agree"]:
            print("HF: mismatch (its step time is not of our computation)", flush=True)
    if device == "cuda" and hf_anchor is not None:
        model = hf_anchor
        with torch.no_grad():
            cache = random_cache(model, args.batch, args.ctx - 1, device)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, 1), device=device)

        def hf_step():
            extra = cache.get_seq_length() - (args.ctx - 1)  # (drop the last step's token;
            if extra > 0:  # negative crop: what every transformers release takes)
                cache.crop(-extra)
            return model(input_ids=ids, past_key_values=cache, use_cache=True)

        with torch.no_grad():
            try:
                hf["eager_dynamic_cache_ms"] = time_steps(hf_step, args.steps, device)
            except Exception as e:  # (recorded: an anchor that fails is a result too)
                hf["eager_dynamic_cache_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print({"hf": hf}, flush=True)
    info = run_info("bench_model_decode")
    info.update(quick=args.quick, mla=args.mla,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                layers=cfg.num_layers, batch=args.batch, ctx=args.ctx,
                dtype=str(dtype), rows=rows, hf=hf)
    write_json(args.out, info)


if __name__ == "__main__":
    main()
