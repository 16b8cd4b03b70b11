"""``python -m attn_ops {info, select, demo}``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import torch

from attn_ops.capabilities import package_version
from attn_ops.platforms import Platform, PlatformKind, current_platform
from attn_ops.registry import get_backend_class
from attn_ops.selector import AttentionConfig, select_backend
from attn_ops.spec import AttentionSpec, AttentionType, KVCacheDType

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float64": torch.float64}


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default means."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the layer (an AttentionSpec)")
    g.add_argument("--heads", type=int, default=32, help="query heads")
    g.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: = --heads)")
    g.add_argument("--head-dim", type=int, default=128, help="QK head dim")
    g.add_argument("--head-dim-v", type=int, default=None,
                   help="V head dim (default: = --head-dim)")
    g.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="model dtype")
    g.add_argument("--kv-cache-dtype", choices=[k.value for k in KVCacheDType], default="auto",
                   help="KV-cache storage (auto: the model dtype)")
    g.add_argument("--block-size", type=int, default=None,
                   help="page size (default: the selected backend's own)")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="keys each query sees, itself included (default: all)")
    g.add_argument("--soft-cap", type=float, default=None,
                   help="logits soft-cap (default: none)")
    g.add_argument("--sinks", action="store_true", help="learned attention sinks")
    g.add_argument("--alibi", action="store_true", help="ALiBi position biases")
    g.add_argument("--attn-type", choices=[t.value for t in AttentionType], default="decoder",
                   help="decoder: causal; encoder_only: bidirectional")


def _add_mla_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("an MLA layer (AttentionSpec.mla; --heads, --dtype, "
                             "--kv-cache-dtype, --block-size apply)")
    g.add_argument("--mla", action="store_true", help="describe an MLA layer (DeepSeek-V2/V3)")
    g.add_argument("--kv-lora-rank", type=int, default=512, help="latent width")
    g.add_argument("--qk-nope-head-dim", type=int, default=128, help="QK width without RoPE")
    g.add_argument("--qk-rope-head-dim", type=int, default=64, help="RoPE width")
    g.add_argument("--v-head-dim", type=int, default=128, help="V width")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="query low-rank width (default: a plain q_proj)")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN's mscale (attn_ops.spec.yarn_mscale); 1 without YaRN")


_STATE_KINDS = ("gdn", "mamba2", "mamba1", "short_conv", "lightning")
_DSV4_KINDS = {"swa": ("sliding_attention", {}),
               "csa": ("compressed_sparse_attention",
                       dict(compress_ratio=4, index_heads=64, index_head_dim=128,
                            index_topk=512)),
               "hca": ("heavily_compressed_attention", dict(compress_ratio=128))}


def _add_state_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("a recurrent-state layer (its kind's default shapes: Qwen3-Next's "
                             "GDN, Mamba2-2.7B, Mamba-2.8B, LFM2's short conv, MiniMax-Text-01's "
                             "lightning; --dtype applies)")
    for kind in _STATE_KINDS:
        g.add_argument(f"--{kind.replace('_', '-')}", dest="state_kind", action="store_const",
                       const=kind, help=f"describe a {kind} layer")
    g.add_argument("--state-dtype", choices=sorted(_DTYPES), default="float32",
                   help="the recurrent state's dtype")
    g = p.add_argument_group("a DeepSeek-V4 attention layer (V4-Flash's shapes; --dtype and "
                             "--kv-cache-dtype auto / fp8_ds_mla apply)")
    g.add_argument("--dsv4", choices=sorted(_DSV4_KINDS), default=None,
                   help="describe a sliding-window (swa), compressed-sparse (csa) or heavily "
                        "compressed (hca) layer")


def _state_spec_from(args):
    from attn_ops.backends.ssm import spec as ssm

    make = {"gdn": ssm.GatedDeltaNetSpec, "mamba2": ssm.Mamba2Spec, "mamba1": ssm.Mamba1Spec,
            "short_conv": ssm.ShortConvSpec, "lightning": ssm.LightningSpec}[args.state_kind]
    return make(dtype=_DTYPES[args.dtype], state_dtype=_DTYPES[args.state_dtype])


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("selection")
    g.add_argument("--platform", default=None,
                   help="simulate a platform: cpu, cuda:9.0, cuda:sm100, rocm, rocm:gfx942, xpu "
                        "(default: this machine)")
    g.add_argument("--backend", default=None,
                   help="force a backend (wins over $ATTN_OPS_BACKEND; default: auto)")
    g.add_argument("--tuning", default="auto",
                   help="the tuning entry the routes read: auto (the platform's), generic, or a "
                        "measured device (H200)")
    g.add_argument("--assume-installed", action="store_true",
                   help="treat the optional packages (flashinfer, flash-attn-4, triton, ...) as "
                        "installed: what a user with the extras gets on that platform")


def _spec_from(args) -> AttentionSpec:
    if getattr(args, "dsv4", None):
        from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec

        if getattr(args, "state_kind", None) or getattr(args, "mla", False):
            raise ValueError("--dsv4 describes a DeepSeek-V4 layer; give it alone")
        layer_type, shape = _DSV4_KINDS[args.dsv4]
        return DeepseekV4Spec(layer_type, dtype=_DTYPES[args.dtype], **shape,
                              kv_cache_dtype="fp8_ds_mla" if args.kv_cache_dtype ==
                              "fp8_ds_mla" else "auto")
    if getattr(args, "state_kind", None):
        if getattr(args, "mla", False):
            raise ValueError(f"--mla and --{args.state_kind.replace('_', '-')} describe two "
                             "layers; give one")
        return _state_spec_from(args)
    if getattr(args, "mla", False):
        return AttentionSpec.mla(
            args.heads, kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
            q_lora_rank=args.q_lora_rank, mscale=args.mscale, dtype=_DTYPES[args.dtype],
            kv_cache_dtype=KVCacheDType(args.kv_cache_dtype), block_size=args.block_size)
    return AttentionSpec(
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        head_dim_v=args.head_dim_v, dtype=_DTYPES[args.dtype],
        kv_cache_dtype=KVCacheDType(args.kv_cache_dtype), block_size=args.block_size,
        sliding_window=args.sliding_window, logits_soft_cap=args.soft_cap,
        has_sinks=args.sinks, use_alibi=args.alibi, attn_type=AttentionType(args.attn_type))


def _platform_from(args) -> Platform:
    platform = Platform.parse(args.platform) if args.platform else current_platform()
    if getattr(args, "assume_installed", False):
        platform = dataclasses.replace(platform, assume_packages=True)
    return platform


def _tuning_from(args, platform):
    from attn_ops.tuning import ENV_TUNING, GENERIC, MEASURED, apply_overrides, resolve_tuning

    name = getattr(args, "tuning", "auto")
    if name == "auto":
        return resolve_tuning(platform)
    entries = {"generic": GENERIC, **{k.lower(): v for k, v in MEASURED.items()}}
    if name.lower() not in entries:
        raise ValueError(f"--tuning {name!r} is not auto, generic or one of "
                         f"{', '.join(MEASURED)}")
    import os

    return apply_overrides(entries[name.lower()], os.environ.get(ENV_TUNING, ""))


def _config_from(args, spec=None) -> AttentionConfig:
    if getattr(args, "state_kind", None) and args.backend:  # (forces the layer's kind)
        return AttentionConfig(backend_per_kind={spec.layer_kind: args.backend})
    return AttentionConfig(backend=args.backend, forced_by="--backend")


def _assumed(platform: Platform) -> list[str]:
    return ["(optional packages assumed installed: --assume-installed)"] \
        if platform.assume_packages else []


def cmd_info(args) -> int:
    from attn_ops.selector import NoBackendError, candidates_for

    platform = _platform_from(args)
    print(f"attn_ops {__import__('attn_ops').__version__}")
    print(f"platform: {platform}")
    print(f"tuning:   {_tuning_from(args, platform).describe()}")
    for dist in ("torch", "triton", "flashinfer-python", "flash-attn-4", "flash-attn",
                 "transformers"):
        version = torch.__version__ if dist == "torch" else package_version(dist)
        print(f"  {dist:<18} {version or 'not installed'}")
    from attn_ops.providers import FA3, FLASHMLA

    for kernel in (FA3, FLASHMLA):  # kernels several packages ship: which one serves here
        found = kernel.found()
        print(f"  {kernel.kernel:<18} " + (f"from {found.label} ({found.module})" if found else
                                           "no provider ("
                                           + "; ".join(p.problem() for p in kernel.providers)
                                           + ")"))
    spec = _spec_from(args)
    print(f"\nbackends for {spec.describe()}:", *_assumed(platform))
    for c in candidates_for(spec, platform):
        state = "available" if c.ok else "unavailable: " + "; ".join(map(str, c.reasons))
        print(f"  {c.name:<18} {state}")
    try:
        sel = select_backend(spec, platform, _config_from(args, spec))
    except NoBackendError:
        print("\nselected: none (every backend has reasons above)")
        return 2
    except ValueError as e:  # a forced backend that cannot run: the table above says why
        print(f"\nselected: none -- {str(e).splitlines()[0]}")
        return 2
    print(f"\nselected: {sel.backend}" + (f" (forced by {sel.forced_by})" if sel.forced_by
                                           else ""))
    return 0


def cmd_select(args) -> int:
    platform = _platform_from(args)
    spec = _spec_from(args)
    sel = select_backend(spec, platform, _config_from(args, spec))
    print(sel.table())
    for line in _assumed(platform):
        print(line)
    if args.batch and getattr(args, "state_kind", None):
        print(f"\n{sel.backend} has no per-step routes to print: its ops pick their kernels "
              "(attn_ops.routing.ssm_kernel)")
    elif args.batch and spec.use_mla:
        from attn_ops import routing
        from attn_ops.backends.flash_attn import GENERATIONS

        tuning = _tuning_from(args, platform)
        step = routing.StepShape.parse(args.batch, args.decode_threshold)
        facts = routing.DeviceFacts.for_platform(platform)
        fa4 = GENERATIONS[4]
        fa4_usable = (platform.kind is PlatformKind.CUDA and platform.capability is not None
                      and fa4.min_capability <= platform.capability <= fa4.max_capability
                      and fa4.package.reason("", platform) is None)
        print(f"\nMLA step of {sel.backend} for --batch {args.batch} ({facts.num_sms} SMs, "
              f"tuning {tuning.describe()}): leading requests with at most "
              f"{tuning.mla.absorbed_max_query_len} new tokens run in the absorbed form")
        from attn_ops.backends.flashinfer import FLASHINFER_PACKAGE

        flashinfer_usable = (platform.kind is PlatformKind.CUDA
                             and FLASHINFER_PACKAGE.reason("", platform) is None)
        from attn_ops.providers import FA3

        fa3_usable = (platform.kind is PlatformKind.CUDA and platform.capability == (9, 0)
                      and FA3.reason("", platform) is None)
        for line in routing.explain_mla(sel.backend, spec, facts, step, tuning, fa4_usable,
                                        flashinfer_usable, fa3_usable):
            print(f"  {line}")
    elif args.batch:
        from attn_ops import routing

        tuning = _tuning_from(args, platform)
        step = routing.StepShape.parse(args.batch, args.decode_threshold)
        facts = routing.DeviceFacts.for_platform(platform)
        triton = not get_backend_class("TRITON_ATTN").not_supported_reasons(spec, platform)
        print(f"\nroutes of {sel.backend} for --batch {args.batch} ({facts.num_sms} SMs, "
              f"tuning {tuning.describe()}):")
        for line in routing.explain(sel.backend, spec, facts, step, tuning, sel.block_size,
                                    triton_takes_spec=triton):
            print(f"  {line}")
    return 0


def demo_hybrid(args) -> int:
    """A hybrid decoder (attention + recurrent layers on one allocator) generating, its prompts
    in chunks of 16 tokens, then decodes; checked against one prefill of the same tokens
    (states carried step to step must give the logits a single pass gives)."""
    from attn_ops.models.hybrid import HybridConfig, HybridGenerator, HybridModel

    torch.manual_seed(args.seed)
    cfg = HybridConfig(num_layers=args.layers, dtype=_DTYPES[args.dtype],
                       linear_kind=args.hybrid)
    model = HybridModel(cfg, AttentionConfig(backend=args.backend, forced_by="--backend")).eval()
    forward = model if args.no_compile else torch.compile(model, fullgraph=True, dynamic=True)
    kinds = ["attention" if cfg.is_attention(i) else args.hybrid for i in range(cfg.num_layers)]
    print(f"platform: {current_platform()}")
    print(f"model:    {cfg.num_layers} layers ({', '.join(kinds)}), hidden {cfg.hidden_size}, "
          f"{str(cfg.dtype).removeprefix('torch.')}; state "
          f"{cfg.state_spec.state_bytes() / 1024:.0f} KiB a request a layer")
    print(f"backend:  attention on {model.attention_layers[0].attn.backend}, "
          f"{'eager' if args.no_compile else 'torch.compile(fullgraph=True)'}")
    slots = len(args.prompt_lens)
    gen = HybridGenerator(model, 256, slots, forward)
    g = torch.Generator().manual_seed(args.seed)
    for rid, n in enumerate(args.prompt_lens):
        gen.add(rid, torch.randint(cfg.vocab_size, (n,), generator=g).tolist())
    steps = max(-(-n // 16) for n in args.prompt_lens) + args.steps
    for _ in range(steps):
        last = gen.step(16)
    once = HybridGenerator(model, 256, slots)  # every token so far in one prefill, eagerly
    for rid, (tokens, _) in gen.requests.items():
        once.add(rid, tokens[:-1])
    worst = (last - once.step()).abs().max().item()
    tol = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}[cfg.dtype]
    ok = worst <= tol
    print(f"check:    max |last step's logits - one prefill's| = {worst:.2e} (tolerance "
          f"{tol:g}) -> {'PASS' if ok else 'FAIL'}")
    for rid, (tokens, _) in sorted(gen.requests.items()):
        n = args.prompt_lens[rid]
        print(f"  request {rid} (state slot {gen.allocator.state_slot(rid)}): prompt {n} "
              f"tokens -> {tokens[n:n + 12]}")
    return 0 if ok else 1


def cmd_demo(args) -> int:
    if args.hybrid:
        return demo_hybrid(args)
    from attn_ops.models.llama import Generator, ModelConfig, TinyLlama

    torch.manual_seed(args.seed)
    cfg = ModelConfig(num_layers=args.layers, dtype=_DTYPES[args.dtype])
    model = TinyLlama(cfg, AttentionConfig(backend=args.backend, forced_by="--backend")).eval()
    reference = TinyLlama(cfg, AttentionConfig(backend="REFERENCE")).eval()
    reference.load_state_dict(model.state_dict())
    passes = []
    if not args.no_compile:  # our Inductor passes fuse RoPE + the cache write (and more)
        from attn_ops import compile_passes

        passes = compile_passes.install().passes
    forward = model if args.no_compile else torch.compile(model, fullgraph=True, dynamic=True)
    print(f"platform: {current_platform()}")
    print(f"model:    {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads "
          f"{cfg.num_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, "
          f"{str(cfg.dtype).removeprefix('torch.')}")
    print(f"backend:  {model.backends[0]} (block_size {model.block_size}), "
          f"{'eager' if args.no_compile else 'torch.compile(fullgraph=True)'}")
    if passes:
        print(f"passes:   {', '.join(p.name for p in passes if hasattr(p, 'name'))} "
              "(Inductor post-grad)")

    gen = Generator(model, num_blocks=256, forward=forward)
    ref = Generator(reference, num_blocks=256)
    g = torch.Generator().manual_seed(args.seed)
    for rid, n in enumerate(args.prompt_lens):
        prompt = torch.randint(cfg.vocab_size, (n,), generator=g).tolist()
        gen.add(rid, prompt)
        ref.add(rid, prompt)

    tol = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}[cfg.dtype]
    worst, decode_time, decode_tokens = 0.0, 0.0, 0
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        start = time.perf_counter()
        logits, meta = gen.step()
        elapsed = time.perf_counter() - start
        ref_logits, _ = ref.step()
        worst = max(worst, (logits - ref_logits).abs().max().item())
        if step >= 2:  # step 0 prefills (and compiles), step 1 compiles the decode shape
            decode_time += elapsed
            decode_tokens += meta.num_actual_tokens
    total = time.perf_counter() - t0
    same = all(gen.requests[r].generated == ref.requests[r].generated for r in gen.requests)
    ok = worst <= tol and same
    print(f"check:    max |logits - REFERENCE| = {worst:.2e} (tolerance {tol:g}); generated "
          f"tokens {'identical' if same else 'DIFFERENT'} -> {'PASS' if ok else 'FAIL'}")
    if decode_tokens:
        print(f"speed:    {decode_tokens / decode_time:.1f} tokens/s decode "
              f"({len(args.prompt_lens)} requests, {decode_tokens} tokens timed, "
              f"{total:.1f} s total incl. compile)")
    for rid, r in sorted(gen.requests.items()):
        print(f"  request {rid}: prompt {len(r.tokens) - len(r.generated)} tokens -> "
              f"{r.generated[:12]}{' ...' if len(r.generated) > 12 else ''}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    fmt = _Help
    parser = argparse.ArgumentParser(prog="python -m attn_ops", formatter_class=fmt,
                                     description="attn_ops: attention backends as torch ops")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log the selection and every rejected backend's reasons")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", formatter_class=fmt,
                       help="platform, tuning, package versions, every backend's state")
    _add_spec_args(p)
    _add_mla_args(p)
    _add_state_args(p)
    _add_selection_args(p)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("select", formatter_class=fmt,
                       help="ranked backend table for a spec, and the routes of a step")
    _add_spec_args(p)
    _add_mla_args(p)
    _add_state_args(p)
    _add_selection_args(p)
    p.add_argument("--batch", default=None,
                   help="print the selected backend's route for each part of this step: "
                        "N x SEQ_LEN[:QUERY_LEN] groups, comma-separated, e.g. "
                        "64x4096,1x8192:8192 (64 decodes over 4096 tokens, a prefill of 8192; "
                        "default: no routes)")
    p.add_argument("--decode-threshold", type=int, default=1,
                   help="query lengths up to this are decodes (speculative decoding: > 1)")
    p.set_defaults(func=cmd_select)
    p = sub.add_parser("demo", formatter_class=fmt,
                       help="generate tokens with a small Llama-style decoder, checked "
                            "against REFERENCE")
    p.add_argument("--backend", default=None, help="force a backend (default: auto)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="model dtype")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--steps", type=int, default=16, help="decode steps after the prefill")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[24, 17, 40, 9],
                   help="one prompt length per request")
    p.add_argument("--seed", type=int, default=0, help="random seed of weights and prompts")
    p.add_argument("--no-compile", action="store_true",
                   help="run eagerly (default: torch.compile(fullgraph=True))")
    p.add_argument("--hybrid", choices=["gated_deltanet", "mamba2", "mamba1", "lightning"],
                   default=None,
                   help="a hybrid decoder instead: every 4th layer attention, the others "
                        "Gated DeltaNet, Mamba2, Mamba1 or lightning attention (checked against "
                        "one prefill of its tokens)")
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
