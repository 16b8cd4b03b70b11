"""Registers, spills and static shared memory of our Triton kernels, compiled
ahead of time for sm_90 (the H200) on any machine -- no GPU needed: Triton's compiler and its
bundled ptxas build the cubin, its cuobjdump reads the resources. A kernel whose registers
spill, or that leaves room for one program an SM, is a poor candidate before any timing.

Each kernel is built at the real shapes its op serves (Mamba-2.8B's d_inner 5120 / d_state 16,
MiniMax-Text-01's lightning heads of 128, Qwen3-Next's GDN heads, Llama-3-8B's attention heads
over TurboQuant slots, DeepSeek-V4's attention over 584-byte entries, V3.2's indexer scoring and
sparse MLA), bf16 inputs, with pointers
and strides specialized as divisible by 16 where Triton's JIT specializes them so at those
shapes (not a TurboQuant slot's stride), over a grid of block configurations:

    python benchmarks/profile_kernel_resources.py [--kernels mamba1_chunked lightning_chunked
        lightning_state lightning_output mamba1_unrolled mamba1_segment mamba1_segment_chain
        mamba1_recurrent lightning_recurrent gdn_recurrent
        turboquant_attention bf16_attention turboquant_write dsv4_attention index_score
        sparse_mla_fp8 sparse_mla_bf16 cuda_decode cuda_write] [--arch 90] [--stages N] [--loop]
        [--layouts] [--cuda-defines MACRO ...] [--out PATH]

``--loop`` also counts the SASS instructions of each kernel's main loop (a thread's, an
iteration); for the attention kernel over TurboQuant slots, the warp instructions a key and KV
head they come to (the decode's instruction budget: ``docs/performance.md``).
``cuda_decode`` builds TurboQuant's CUDA decode (``decode_kernels.cu``) with the machine's
nvcc instead, each instantiation a row (``--cuda-defines``: its build's macros); ``cuda_write``
its CUDA write (``write_kernels.cu``), with each instantiation's static instruction count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import tempfile

BF16_PTRS = ("x_ptr", "dt_ptr", "b_ptr", "c_ptr", "z_ptr", "y_ptr", "q_ptr", "k_ptr", "v_ptr",
             "o_ptr")
INT_PTRS = ("qsl_ptr", "slot_ptr")


# TRITON_ATTN's attention kernel reading a TurboQuant cache (a bf16 one): its arguments' types
TQ_TYPES = {"k_ptr": "*u8", "v_ptr": "*u8", "out_ptr": "*bf16", "qsl_ptr": "*i32",
            "seq_ptr": "*i32", "bt_ptr": "*i32", "tree_ptr": "*i64", "counter_ptr": "*i32",
            "scale": "fp32", "soft_cap": "fp32", "inv_sqrt_d": "fp32"}
BF16_TYPES = dict(TQ_TYPES, k_ptr="*bf16", v_ptr="*bf16")


DECODE_TILES = (("decode", 16, 64, 8, 8), ("decode", 16, 32, 4, 8), ("decode", 16, 64, 4, 8),
                ("decode", 16, 64, 2, 8), ("decode", 16, 32, 2, 8), ("decode", 16, 128, 4, 8),
                ("decode", 16, 16, 4, 8), ("decode", 16, 16, 2, 8), ("decode", 16, 32, 8, 8))


def _turboquant_attention(presets=None, tiles=None):
    """(kernel, points) of TRITON_ATTN's kernel over TurboQuant slots: Llama-3-8B's heads,
    split decode tiles and unsplit prefill tiles, each preset (``bf16``: a bf16 cache, the
    bound's reference)."""
    from attn_ops.backends import triton_attn_kernels as ak
    from attn_ops.backends.triton_attn import turboquant_read_constants

    presets = presets or {"4bit_nc": (4, 4, True), "k3v4_nc": (3, 4, True),
                          "3bit_nc": (3, 3, True), "k8v4": (8, 4, False),
                          "4bit_nc planes": (4, 4, True, "planes"),
                          "k8v4 planes": (8, 4, False, "planes"),
                          "4bit_nc coalesced": (4, 4, True, "coalesced"),
                          "3bit_nc coalesced": (3, 3, True, "coalesced"),
                          "4bit_nc planes coalesced": (4, 4, True, "planes", "coalesced"),
                          "k3v4_nc planes coalesced": (3, 4, True, "planes", "coalesced"),
                          "k8v4 planes coalesced": (8, 4, False, "planes", "coalesced")}
    tiles = tiles or (*DECODE_TILES, ("prefill", 128, 32, 8, 1), ("prefill", 128, 64, 8, 1),
                      ("prefill", 64, 64, 4, 1))
    points = []
    for (name, (kb, vb, nc, *read)), (kind, rows, keys, warps, splits) in itertools.product(
            presets.items(), tiles):
        planes, coalesced = "planes" in read, "coalesced" in read
        consts = dict(GROUP=4, GROUP_P=4, HQ=32, PAGE=16, BLOCK_Q=rows // 4, BLOCK_N=keys, D=128,
                      D_P=128, DV=128, DV_P=128, CAUSAL=True, USE_WINDOW=False,
                      USE_SOFTCAP=False, HAS_ALIBI=False, HAS_SINKS=False, FP8=False,
                      WRITE_LSE=True, NUM_SPLITS=splits, PRECISION="tf32", HAS_TREE=False,
                      FUSED_COMBINE=splits > 1, HEADS_FASTEST=False, ONE_ROW=kind == "decode",
                      **(turboquant_read_constants(kb, vb, nc, planes, coalesced) if kb != 16
                         else dict(KV_FORMAT=0, KEY_BITS=kb, VALUE_BITS=vb,
                                   NORM_CORRECTION=nc, KEY_PLANES=False,
                                   VALUE_PLANES=False, TQ_COALESCED=False)))
        points.append((f"{name} {kind} {rows} x {keys}", consts, warps))
    return ak.paged_attention_kernel, points


WRITE_TYPES = {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*u8", "slot_ptr": "*i64",
               "mid_ptr": "*fp32", "cell_ptr": "*i32", "cs_ptr": "*fp32", "inv_sqrt_d": "fp32",
               "grid_scale": "fp32", "grid_offset": "fp32"}


# lightning attention's split prefill: its start-state buffer (bf16 for bf16 inputs) and chunk
# table
SPLIT_TYPES = {"h_ptr": "*bf16", "coff_ptr": "*i32", "start_ptr": "*i32", "end_ptr": "*i32"}
# Mamba1's segments: fp32 states and time-step sums, the chunk table
# (the unrolled walks read B / C converted to fp32 once a launch)
UNROLLED_TYPES = {"b_ptr": "*fp32", "c_ptr": "*fp32"}
SEGMENT_TYPES = {"hs_ptr": "*fp32", "sum_ptr": "*fp32", "coff_ptr": "*i32", "start_ptr": "*i32",
                 "end_ptr": "*i32", **UNROLLED_TYPES}


def _turboquant_write():
    """(kernel, points) of TurboQuant's cache write: head dim 128, RoPE, 4- and 3-bit presets
    (and k8v4), tokens a program x warps; the rotated presets also with the butterfly
    rotation and the codes' binary search (``triton.turboquant_write_fwht`` / ``_search``),
    and every preset with the codes from cells and the values by Markstein steps
    (``triton.turboquant_write_lookup``)."""
    from attn_ops.backends.turboquant.write_kernels import cache_write_kernel, clear_tiles

    points = []
    for (kb, vb, slot), (tokens, warps), mode in itertools.product(
            ((4, 4, 134), (3, 3, 102), (8, 4, 196)), ((16, 8), (16, 4), (32, 8)),
            ("", "fwht search", "lookup")):
        if mode == "fwht search" and kb == 8:  # (fp8 keys: no rotation, no codebook)
            continue
        consts = dict(D=128, D_P=128, PAGE=16, SLOT=slot, SLOT_P=256, KEY_BITS=kb,
                      VALUE_BITS=vb, PAD=False, ROPE=True, BLOCK_T=tokens, **clear_tiles(16, slot),
                      FWHT=mode == "fwht search", SEARCH=mode == "fwht search",
                      LOOKUP=mode == "lookup")
        points.append((f"k{kb}v{vb} {tokens} tokens" + (f" {mode}" if mode else ""), consts,
                       warps))
    return cache_write_kernel, points


# DSV4_TRITON's attention kernel over vLLM's 584-byte entries: its arguments' types
DSV4_TYPES = {"q_ptr": "*bf16", "win_ptr": "*u8", "comp_ptr": "*u8", "qsl_ptr": "*i32",
              "seq_ptr": "*i32", "bt_ptr": "*i32", "cbt_ptr": "*i32", "picks_ptr": "*i32",
              "out_ptr": "*bf16", "sm_scale": "fp32"}


def _dsv4_attention():
    """(kernel, points) of DSV4_TRITON's attention: V4-Flash's 64 heads of 448 + 64 over the
    window and the indexer's picks (C4A), heads a program x keys a step x warps (``--stages``
    sets the pipeline depth; the default launch runs 2)."""
    import triton.language as tl

    from attn_ops.backends.deepseek_v4.kernels import dsv4_attention_kernel

    points = []
    for heads, keys, warps in itertools.product((64, 32, 16), (64, 32), (8, 4)):
        consts = dict(H=64, HEADS=heads, NOPE_D=448, NOPE_P=512, ROPE_D=64, ROPE_P=64,
                      DV_P=512, WPAGE=64, CPAGE=64, BLOCK_N=keys, SPLITS=2, WIN_ENTRIES=True,
                      COMP_ENTRIES=True, MODE=2, COMPUTE=tl.bfloat16, PRECISION="tf32")
        points.append((f"{heads} heads x {keys} keys", consts, warps))
    return dsv4_attention_kernel, points


# The sparse-MLA indexer's scoring over fp8 keys with a scale a key (DeepSeek-V3.2 / V4)
INDEX_TYPES = {"q_ptr": "*bf16", "w_ptr": "*fp32", "keys_ptr": "*fp8e4nv", "scales_ptr": "*fp32",
               "table_ptr": "*i32", "req_ptr": "*i32", "vis_ptr": "*i32", "out_ptr": "*fp32",
               "hist_ptr": "*i32"}


def _index_score():
    """(kernel, points) of the indexer's scoring: 64 heads of 128, fp8 keys, page 64, the
    query in e4m3 (``Tuning.mla.index_fp8_query``), keys a step x keys as rows or not."""
    import triton.language as tl

    from attn_ops.backends.mla.indexer_kernels import index_score_kernel

    points = []
    for block_n, rows in itertools.product((256, 128, 64), (True, False)):
        consts = dict(H=64, H_P=64, D=128, D_P=128, PAGE=64, GROUP=128, HAS_SCALES=True,
                      SCALE_AFTER=True, COMPUTE=tl.bfloat16, BLOCK_N=block_n, PRECISION="tf32",
                      HIST=False, FP8_Q=True, KEYS_M=rows)
        points.append((f"{block_n} keys" + (", keys as rows" if rows else ""), consts, 4))
    return index_score_kernel, points


SELECT_TYPES = {"scores_ptr": "*fp32", "vis_ptr": "*i32", "hist_ptr": "*i32",
                "counts_ptr": "*i32", "out_ptr": "*i32", "cand_ptr": "*i32"}


def _ik():
    from attn_ops.backends.mla import indexer_kernels

    return indexer_kernels


def _index_select(name: str, **consts):
    """(kernel, points) of one of the indexer's top-k select launches (``indexer_kernels.
    <name>``: fp32 scores, 1024 a tile, 4 warps), its first tile read before the row's
    histogram state or not (``Tuning.mla.index_select_read_first``)."""
    from attn_ops.backends.mla import indexer_kernels as ik

    return getattr(ik, name), [("read first" if first else "in order",
                                dict(consts, BLOCK=1024, READ_FIRST=first), 4)
                               for first in (True, False)]


def _sparse_mla(fp8: bool):
    """(kernel, points) of TRITON_MLA_SPARSE: DeepSeek-V3.2's 128 heads over latents of 512 +
    64 gathered by slot (fp8 e4m3 or bf16), the default tile and a smaller one."""
    from attn_ops.backends.mla.sparse_kernels import sparse_mla_kernel

    points = []
    for heads, keys, warps in ((64, 64, 8), (32, 32, 4)):
        consts = dict(H=128, HEADS=heads, RANK=512, RANK_P=512, ROPE=64, ROPE_P=64, PAGE=64,
                      BLOCK_N=keys, SPLITS=2, FP8=fp8, PRECISION="tf32", FLAGGED=False)
        points.append((f"{heads} heads x {keys} keys", consts, warps))
    return sparse_mla_kernel, points


SPARSE_TYPES = {"ql_ptr": "*bf16", "qpe_ptr": "*bf16", "cache_ptr": "*fp8e4nv",
                "slots_ptr": "*i32", "out_ptr": "*bf16", "sm_scale": "fp32"}


def configs() -> dict[str, tuple]:
    """kernel name -> (the kernel, [(label, constexprs, warps), ...])."""
    from attn_ops.backends.ssm import lightning_kernels as lk
    from attn_ops.backends.ssm import mamba1_kernels as mk
    from attn_ops.backends.ssm import triton_kernels as tk

    m1 = dict(D_INNER=5120, N=16, BLOCK_N=16, HAS_Z=True, SOFTPLUS=True)
    light = dict(DK=128, DV=128, BLOCK_K=128)
    return {
        "mamba1_chunked": (mk.mamba1_chunked_kernel, [
            (f"chunk {c} x {d} channels", dict(m1, CHUNK=c, BLOCK_D=d, PREFETCH=True), w)
            for c, d, w in itertools.product((8, 16, 32), (16, 32, 64), (4, 8))]),
        "lightning_chunked": (lk.lightning_chunked_kernel, [
            (f"chunk {c} x {v} columns", dict(light, CHUNK=c, BLOCK_V=v, IEEE=False), w)
            for c, v, w in itertools.product((32, 64), (32, 64, 128), (4, 8))]),
        "lightning_state": (lk.lightning_state_kernel, [
            (f"chunk {c} x {kr} rows x {v} columns",
             dict(light, H=64, CHUNK=c, BLOCK_K=kr, BLOCK_V=v, IEEE=False), w)
            for c, kr, v, w in itertools.product((64, 128), (32, 64, 128), (32, 64, 128),
                                                 (4, 8))]),
        "lightning_output": (lk.lightning_output_kernel, [
            (f"chunk {c} x {v} columns", dict(light, H=64, CHUNK=c, BLOCK_V=v, IEEE=False), w)
            for c, v, w in itertools.product((64, 128), (64, 128), (4, 8))]),
        "mamba1_unrolled": (mk.mamba1_unrolled_kernel, [
            (f"{d} channels" + (f" prefetch {p}" if p else "") + (f" y parts {y}" if y > 1
                                                                   else ""),
             dict(m1, NUM_WRITES=0, BLOCK_D=d, PREFETCH=p, Y_PARTS=y, L2_AHEAD=0), w)
            for d, w, p, y in itertools.product((64, 128, 256), (2, 4), (0, 1, 2), (1, 2, 4))]),
        "mamba1_segment": (mk.mamba1_segment_kernel, [
            (f"{d} channels" + (" outputs" if o else " states") + (f" prefetch {p}" if p else "")
             + (f" y parts {y}" if y > 1 else ""),
             dict(D_INNER=5120, N=16, HAS_Z=True, SOFTPLUS=True, BLOCK_D=d, PREFETCH=p,
                  OUTPUT=o, Y_PARTS=y, L2_AHEAD=0), w)
            for d, w, o, p, y in itertools.product((128, 256), (4,), (False, True), (0, 2),
                                                   (1, 2, 4)) if o or y == 1]),
        "mamba1_segment_chain": (mk.mamba1_segment_chain_kernel, [
            (f"{d} channels", dict(D_INNER=5120, N=16, BLOCK_D=d), 4) for d in (128, 256)]),
        "mamba1_recurrent": (tk.mamba1_recurrent_kernel, [
            (f"{d} channels", dict(m1, NUM_WRITES=0, BLOCK_D=d, PREFETCH=True, EVICT="",
                                  STORE="", CHANNEL_MAJOR=False), w)
            for d, w in itertools.product((32, 64, 128), (4, 8))]),
        "lightning_recurrent": (tk.lightning_recurrent_kernel, [
            (f"{v} columns", dict(light, NUM_WRITES=0, BLOCK_V=v, EVICT="", STORE=""), w)
            for v, w in itertools.product((32, 64, 128), (4, 8))]),
        "gdn_recurrent": (tk.gdn_recurrent_kernel, [
            (f"{v} columns", dict(NUM_WRITES=0, GROUP=2, DK=128, DV=128, BLOCK_K=128,
                                  BLOCK_V=v, L2NORM=True, EVICT="evict_first", STORE=".cs"), w)
            for v, w in itertools.product((64, 128), (4, 8))]),
        "turboquant_attention": _turboquant_attention(),
        "bf16_attention": _turboquant_attention({"bf16": (16, 16, False)}, DECODE_TILES),
        "turboquant_write": _turboquant_write(),
        "dsv4_attention": _dsv4_attention(),
        "index_score": _index_score(),
        "index_hist_pass0": _index_select("topk_hist_kernel", PASS=0, ATOMIC=False),
        "index_hist_pass2": _index_select("topk_hist_kernel", PASS=2, ATOMIC=True),
        "index_count": _index_select("topk_count_kernel"),
        "index_write": _index_select("topk_write_kernel", BLOCKS_P=128),
        "index_compact": (_ik().topk_compact_kernel, [("compact", dict(BLOCK=1024), 4)]),
        "index_finish": (_ik().topk_finish_kernel, [
            (f"{cap} candidates, top-k {k}", dict(CAP_P=cap, TOPK_P=k, BLOCK=1024), 8)
            for cap, k in ((4096, 512), (4096, 2048))]),
        "sparse_mla_fp8": _sparse_mla(True),
        "sparse_mla_bf16": _sparse_mla(False),
    }


# Arguments Triton's JIT does not specialize as divisible by 16 at the real shapes: a
# TurboQuant slot's stride (134 bytes at 4bit_nc, head dim 128)
UNALIGNED = {"turboquant_attention": ("stride_ks", "stride_vs")}


def build(fn, constexprs: dict, warps: int, arch: int, types: dict | None = None,
          unaligned: tuple = (), stages: int | None = None):
    """``fn`` compiled for ``sm_<arch>`` (Triton's ``CompiledKernel``; ``stages``: its
    ``num_stages``, Triton's default where None)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {}
    for n in names:
        if n in constexprs:
            signature[n] = "constexpr"
        elif types and n in types:
            signature[n] = types[n]
        elif n in BF16_PTRS:
            signature[n] = "*bf16"
        elif n in INT_PTRS:
            signature[n] = "*i32"
        elif n == "init_ptr":
            signature[n] = "*i1"
        else:
            signature[n] = "*fp32" if n.endswith("_ptr") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and n not in unaligned
             and (n.endswith("_ptr") or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in constexprs.items()})
    options = {"num_warps": warps} if stages is None else {"num_warps": warps,
                                                           "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _cuobjdump(kernel, *flags: str) -> str:
    """cuobjdump (Triton's) over a compiled Triton kernel or a cubin's bytes."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel if isinstance(kernel, bytes) else kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def resources(kernel) -> dict:
    """A compiled kernel's registers a thread, spilled bytes (stack), static shared bytes,
    from cuobjdump's resource usage."""
    return _usage(_cuobjdump(kernel, "--dump-resource-usage"))


def _usage(text: str) -> dict:
    """:func:`resources` of one function's line of cuobjdump's resource usage."""
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", text))
    return {"registers": int(found["REG"]), "spilled_bytes": int(found["STACK"]),
            "static_shared_bytes": int(found["SHARED"])}


def main_loop(kernel, function: str | None = None) -> dict:
    """The SASS instructions of a compiled kernel's main loop a thread runs an iteration -- the
    span of a backward branch: of those with the most tensor-core instructions the shortest
    (the attention kernel's unmasked key blocks, not its masked edges), else the longest --
    and the opcodes among them; ``loop_instructions_common``: less the largest block in it
    that a forward branch skips (a path most iterations do not take, as the rescale of the
    output a new running maximum takes). ``function``: one function of a cubin's."""
    at = re.compile(r"/\*([0-9a-f]{4,})\*/")
    sass = _cuobjdump(kernel, "-sass", *(("-fun", function) if function else ()))
    lines = [line for line in sass.splitlines() if at.search(line)]
    body, rank = [], (0, -1 << 30)
    for line in lines:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line)
        end = int(at.search(line).group(1), 16)
        if target and int(target.group(1), 16) < end:
            start = int(target.group(1), 16)
            span = [x for x in lines if start <= int(at.search(x).group(1), 16) <= end]
            mma = sum("MMA" in x for x in span)
            span_rank = (mma, -len(span) if mma else len(span))
            if span_rank > rank:
                body, rank = span, span_rank
    opcodes: dict[str, int] = {}
    for line in body:
        op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if op:
            opcodes[op.group(1)] = opcodes.get(op.group(1), 0) + 1
    addresses = [int(at.search(x).group(1), 16) for x in body]
    skipped = 0
    for line, here in zip(body, addresses):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line)
        if target and here < int(target.group(1), 16) <= (addresses[-1] if addresses else 0):
            skipped = max(skipped, sum(here < a < int(target.group(1), 16) for a in addresses))
    return {"loop_instructions": len(body), "loop_instructions_common": len(body) - skipped,
            "loop_opcodes": dict(sorted(opcodes.items(), key=lambda kv: -kv[1]))}


CUDA_DECODE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "backends", "turboquant", "decode_kernels.cu")


CUDA_WRITE = os.path.join(os.path.dirname(CUDA_DECODE), "write_kernels.cu")


def _kernels_cubin(source: str, arch: int, defines: list[str]) -> bytes:
    """A CUDA source's kernels alone (``ATTN_OPS_KERNEL_ONLY``: no torch host code) built by
    this machine's nvcc for ``arch`` under ``-D`` ``defines``, with torch's extension flags:
    the cubin's bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernels.cubin")
        subprocess.run(["nvcc", f"-arch=sm_{arch}", "-O3", "-cubin", "-std=c++17",
                        "--expt-relaxed-constexpr", "-DATTN_OPS_KERNEL_ONLY",
                        *(f"-D{d}" for d in defines),
                        *(f"-D__CUDA_NO_{x}__" for x in ("HALF_OPERATORS", "HALF_CONVERSIONS",
                                                           "BFLOAT16_CONVERSIONS",
                                                           "HALF2_OPERATORS")),
                        "-o", cubin, source], check=True)
        with open(cubin, "rb") as f:
            return f.read()


def cuda_write_rows(arch: int) -> list[dict]:
    """TurboQuant's CUDA write (``write_kernels.cu``, its kernels alone, built with this
    machine's nvcc for ``arch``): each instantiation's registers, spills and SASS instructions
    a thread (static: 16 coordinates of a key and of a value a thread, the slow paths and the
    page clear included)."""
    data = _kernels_cubin(CUDA_WRITE, arch, [])
    usage = _cuobjdump(data, "--dump-resource-usage")
    sass = _cuobjdump(data, "-sass")
    rows = []
    for name, body in re.findall(r"Function (\S*tq_write_kernel\S*):\n(.*)", usage):
        # (_ZN...tq_write_kernelILi128E13__nv_bfloat16Li4ELi4EE...: head dim, dtype, bits)
        d, dtype, kb, vb = re.search(r"ILi(\d+)E(\w+?)Li(\d)ELi(\d)E", name).groups()
        code = sass.split(f"Function : {name}")[1].split("Function : ")[0]
        count = len(re.findall(r"/\*[0-9a-f]{4}\*/\s+\S", code))
        rows.append({"kernel": "cuda_write", "warps": 4, "instructions": count,
                     "config": f"D{d} {dtype.lstrip('0123456789_')} k{kb}v{vb}",
                     **_usage(body)})
    return rows


def cuda_decode_rows(arch: int, defines: list[str], loop: bool) -> list[dict]:
    """TurboQuant's CUDA decode (``decode_kernels.cu``, its kernels alone, built with this
    machine's nvcc for ``arch`` under ``-D`` ``defines``, e.g. ATTN_OPS_TQ_NORM_MMA): each
    instantiation's registers and spills and, with ``loop``, its step loop (a warp's 16 keys;
    ``loop_instructions_common`` leaves out the output's rescale)."""
    data = _kernels_cubin(CUDA_DECODE, arch, defines)
    usage = _cuobjdump(data, "--dump-resource-usage")
    rows = []
    for name, body in re.findall(r"Function (\S*tq_decode_kernel\S*):\n(.*)", usage):
        # (_ZN...tq_decode_kernelILi128ELb1ELb1ELi4ELi4EE...: head dim, bf16, norm corrected,
        # key bits, value bits)
        d, bf16, nc, kb, vb = re.search(r"ILi(\d+)ELb(\d)ELb(\d)ELi(\d)ELi(\d)E", name).groups()
        row = {"kernel": "cuda_decode", "warps": 4,
               "config": f"D{d} {'bf16' if bf16 == '1' else 'fp16'} k{kb}v{vb}"
                         + (" " + " ".join(defines) if defines else ""),
               **_usage(body)}
        if loop:
            row.update(main_loop(data, name))
        rows.append(row)
    return rows


def load_layouts(kernel) -> dict:
    """A compiled kernel's dynamic shared memory and the distinct layouts of its global loads
    (TTGIR): ``"SHAPE ELEMENT": "sizePerThread / threadsPerWarp / order"`` -- whether a warp's
    lanes run along a row's contiguous bytes or across rows (one cache line each)."""
    ttgir = kernel.asm["ttgir"]
    named = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*)>$", ttgir, re.M))
    loads = {}
    for shape, elem, name in re.findall(
            r"tt\.load [^:]*: tensor<([0-9x]+)x!tt\.ptr<(\w+)>, (#\w+)>", ttgir):
        fields = dict(re.findall(r"(sizePerThread|threadsPerWarp|order) = \[([0-9, ]+)\]",
                                 named.get(name, "")))
        loads[f"{shape} {elem}"] = " / ".join(f"{k} [{fields.get(k, '?')}]" for k in
                                              ("sizePerThread", "threadsPerWarp", "order"))
    return {"dynamic_shared_bytes": kernel.metadata.shared, "loads": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+",
                        default=["mamba1_chunked", "lightning_chunked", "lightning_state",
                                 "lightning_output", "mamba1_unrolled", "mamba1_segment",
                                 "mamba1_segment_chain", "mamba1_recurrent",
                                 "lightning_recurrent", "gdn_recurrent", "turboquant_attention",
                                 "bf16_attention", "turboquant_write"])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--loop", action="store_true",
                        help="also count the SASS instructions of each kernel's main loop")
    parser.add_argument("--layouts", action="store_true",
                        help="also record each build's dynamic shared memory and load layouts")
    parser.add_argument("--stages", type=int, default=None,
                        help="num_stages of every build (default: Triton's; TurboQuant's "
                             "decode runs 1)")
    parser.add_argument("--cuda-defines", nargs="*", default=[],
                        help="kernel cuda_decode: -D macros of its build (e.g. "
                             "ATTN_OPS_TQ_NORM_MMA, ATTN_OPS_TQ_MIN_BLOCKS=3)")
    parser.add_argument("--only", default="",
                        help="only the configurations whose label contains this text")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "kernel_resources.json"))
    args = parser.parse_args()
    table = configs()
    rows = []
    for name in args.kernels:
        if name == "cuda_write":  # (CUDA C++, built with nvcc, not Triton)
            for row in cuda_write_rows(args.arch):
                rows.append(row)
                print(f"{name:20s} {row['config']:24s} 4 warps: {row['registers']:3d} "
                      f"registers, {row['spilled_bytes']:5d} B spilled, "
                      f"{row['instructions']} instructions a thread", flush=True)
            continue
        if name == "cuda_decode":  # (CUDA C++, built with nvcc, not Triton)
            for row in cuda_decode_rows(args.arch, args.cuda_defines, args.loop):
                rows.append(row)
                print(f"{name:20s} {row['config']:24s} 4 warps: {row['registers']:3d} "
                      f"registers, {row['spilled_bytes']:5d} B spilled"
                      + (f", loop {row['loop_instructions']} instructions a thread "
                         f"({row['loop_instructions_common']} without the rescale)"
                         if args.loop else ""), flush=True)
            continue
        fn, points = table[name]
        for label, constexprs, warps in points:
            if args.only not in label:
                continue
            try:
                kernel = build(fn, constexprs, warps, args.arch,
                               {"turboquant_attention": TQ_TYPES,
                                "turboquant_write": WRITE_TYPES,
                                "bf16_attention": BF16_TYPES,
                                "lightning_state": SPLIT_TYPES,
                                "lightning_output": SPLIT_TYPES,
                                "mamba1_unrolled": UNROLLED_TYPES,
                                "mamba1_segment": SEGMENT_TYPES,
                                "mamba1_segment_chain": SEGMENT_TYPES,
                                "dsv4_attention": DSV4_TYPES,
                                "index_score": INDEX_TYPES,
                                **dict.fromkeys(("index_hist_pass0", "index_hist_pass2",
                                                 "index_count", "index_write",
                                                 "index_compact", "index_finish"),
                                                SELECT_TYPES),
                                "sparse_mla_fp8": SPARSE_TYPES,
                                "sparse_mla_bf16": dict(SPARSE_TYPES, cache_ptr="*bf16")
                                }.get(name),
                               UNALIGNED.get(name, ()), args.stages)
                row = resources(kernel)
                if args.layouts:
                    row.update(load_layouts(kernel))
                if args.loop:
                    row.update(main_loop(kernel))
                    if name in ("turboquant_attention", "bf16_attention"):  # (BLOCK_N keys)
                        row["warp_instructions_a_key"] = round(
                            row["loop_instructions"] * warps / constexprs["BLOCK_N"], 1)
            except Exception as e:  # noqa: BLE001 -- a configuration that fails to build
                row = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append({"kernel": name, "config": label, "warps": warps, **row})
            shown = (f"{row['registers']:3d} registers, {row['spilled_bytes']:5d} B spilled"
                     if "error" not in row else row["error"])
            if "loop_instructions" in row:
                shown += f", loop {row['loop_instructions']} instructions a thread"
            if "warp_instructions_a_key" in row:
                shown += (f" ({row['warp_instructions_a_key']} warp instructions a key and KV "
                          "head)")
            print(f"{name:20s} {label:24s} {warps} warps: {shown}", flush=True)
            for load, layout in row.get("loads", {}).items():
                print(f"    load {load:16s} {layout}")
            if "dynamic_shared_bytes" in row:
                print(f"    dynamic shared memory {row['dynamic_shared_bytes']} B")
    with open(args.out, "w") as f:
        json.dump({"arch": args.arch, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
