"""What ``python -m attn_ops select ... --batch`` prints: the route of every part of a step, from
every family's rules (this module sits above them)."""

from __future__ import annotations

from dataclasses import dataclass

from attn_ops.routing.attention import (composite_decode_route, fa4_batch, fa4_tile,
                                        flashinfer_decode_split, triton_decode_tile,
                                        triton_fused_combine, triton_num_splits,
                                        triton_prefill_tile)
from attn_ops.routing.common import DeviceFacts, Kernel, PartRoute, triton_head_tiles
from attn_ops.routing.mla import (flashinfer_mla_kernel, mla_absorbed_route, mla_decode_launch,
                                  mla_prefill_kernel)
from attn_ops.tuning import Tuning

__all__ = ["StepShape", "explain", "explain_mla"]

# ---------------------------------------------------------------------------------------------
# explain: the route of every part of a step


@dataclass(frozen=True)
class StepShape:
    """A step as the CLI describes it: ``(requests, seq_len, query_len)`` groups, decode-first
    (query lengths of at most ``decode_threshold`` are decodes)."""

    groups: tuple[tuple[int, int, int], ...]
    decode_threshold: int = 1

    @classmethod
    def parse(cls, text: str, decode_threshold: int = 1) -> StepShape:
        """``"64x4096,1x8192:8192"``: 64 requests of 4096 tokens decoding one each, one
        request of 8192 tokens all new (``N x SEQ_LEN[:QUERY_LEN]``, query length 1 if left
        out)."""
        groups = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                count, _, rest = part.lower().partition("x")
                seq, _, query = rest.partition(":")
                group = (int(count), int(seq), int(query) if query else 1)
            except ValueError:
                raise ValueError(f"--batch {part!r} is not N x SEQ_LEN[:QUERY_LEN], e.g. 64x4096 "
                                 "(64 decodes of 4096 tokens) or 1x8192:8192 (a prefill of "
                                 "8192)") from None
            if min(group) < 1 or group[2] > group[1]:
                raise ValueError(f"--batch {part!r}: counts and lengths must be >= 1 and the "
                                 "query length at most the sequence length")
            groups.append(group)
        if not groups:
            raise ValueError("--batch is empty; e.g. --batch 64x4096,1x8192:8192")
        ordered = sorted(groups, key=lambda g: g[2] > decode_threshold)  # (stable)
        return cls(tuple(ordered), decode_threshold)

    def parts(self) -> list[tuple[str, int, int, int, int]]:
        """``(name, requests, rows, longest query, longest seq_len)`` of the decode and the
        prefill part (those with requests)."""
        out = []
        for name, is_decode in (("decode", True), ("prefill", False)):
            gs = [g for g in self.groups if (g[2] <= self.decode_threshold) == is_decode]
            if gs:
                out.append((name, sum(g[0] for g in gs), sum(g[0] * g[2] for g in gs),
                            max(g[2] for g in gs), max(g[1] for g in gs)))
        return out


def explain(backend: str, spec, facts: DeviceFacts, step: StepShape, tuning: Tuning,
            block_size: int, *, triton_takes_spec: bool = True) -> list[str]:
    """One line per part of ``step`` (or one for the step, where ``backend`` runs it in one
    call): the kernel ``backend`` runs it on and why."""
    parts = step.parts()
    if backend in ("FLASH_ATTN", "FLASH_ATTN_DIFFKV", "FLEX_ATTENTION"):  # one call a step
        requests, rows = sum(p[1] for p in parts), sum(p[2] for p in parts)
        max_q, max_seq = max(p[3] for p in parts), max(p[4] for p in parts)
        head = f"whole step: {requests} request(s), {rows} query rows, up to {max_seq} keys"
        if backend == "FLEX_ATTENTION":
            layout = ("decode layout (one batch element per request)" if max_q == 1 else
                      "paged slots, gathered into 128-key pages where the pairs pay for it")
            return [f"{head} -> FlexAttention, {layout}"]
        group = spec.num_heads // spec.kv_heads
        return [f"{head} -> " + _describe_fa4(spec, facts, tuning, rows, requests, max_q, group,
                                              decode=max_q == 1, uniform=len(parts) == 1)]
    lines = []
    for name, requests, rows, max_q, max_seq in parts:
        pages = -(-max_seq // block_size)
        head = f"{name} part: {requests} request(s), {rows} query rows, up to {max_seq} keys"
        route = _explain_part(backend, spec, facts, tuning, name == "decode", requests, rows,
                              max_q, pages, block_size, triton_takes_spec)
        lines.append(f"{head} -> {route}")
    return lines


def _explain_part(backend, spec, facts, tuning, decode, requests, rows, max_q, pages,
                  block_size, triton_takes_spec) -> str:
    kv, group = spec.kv_heads, spec.num_heads // spec.kv_heads
    if backend == "COMPOSITE_SM90":
        if decode:
            tile = fa4_tile(facts.major, spec.head_dim, spec.v_head_dim, spec.dtype, 1, group,
                            tuning.flash_attn)
            return _describe(composite_decode_route(
                requests, kv, pages, block_size, max_q, facts, tuning,
                triton_takes_spec=triton_takes_spec, fa4_decode_tile=tile,
                fp8_cache=spec.kv_cache_dtype.is_fp8))
        return _describe_fa4(spec, facts, tuning, rows, requests, max_q, group, uniform=True)
    if backend == "FLASHINFER":
        if decode:
            split = flashinfer_decode_split(requests, kv, pages, block_size, facts.num_sms,
                                            tuning.flashinfer)
            return f"{Kernel.FLASHINFER_FA2.value}, {split}"
        fa3 = facts.major == 9 and spec.v_head_dim == spec.head_dim \
            and not spec.kv_cache_dtype.is_fp8 and spec.head_dim in (64, 128, 256)
        return (Kernel.FLASHINFER_FA3 if fa3 else Kernel.FLASHINFER_FA2).value
    if backend in ("TRITON_ATTN", "TREE_ATTN"):
        wide = max(triton_head_tiles(spec.head_dim, spec.v_head_dim,
                                     spec.cache_dtype.itemsize)) <= 128
        if decode:
            splits = triton_num_splits(requests, kv, pages * block_size, facts.num_sms,
                                       tuning.triton)
            tile = triton_decode_tile(requests * kv, splits, spec.cache_dtype.itemsize,
                                      facts.num_sms, wide, tuning.triton)
            combine = ("combined in the kernel" if triton_fused_combine(requests, kv,
                                                                          tuning.triton)
                       else "combined by a second kernel")
            return (f"TRITON_ATTN decode, {splits} split(s)"
                    + (f" ({combine})" if splits > 1 else "") + f", tile {tuple(tile)}")
        tile = triton_prefill_tile(wide, spec.dtype.itemsize, pages * block_size, tuning.triton)
        return f"TRITON_ATTN prefill, tile {tuple(tile)}"
    return f"{backend}'s own kernel (no per-step routing)"


def _describe(r: PartRoute) -> str:
    text = r.kernel.value
    if r.split is not None:
        text += f", {r.split}"
    if r.fa4_tile is not None:
        text += f", tile {r.fa4_tile.rows}x{r.fa4_tile.keys}"
    return text + (f" ({r.why})" if r.why else "")


def _describe_fa4(spec, facts, tuning, rows, requests, max_q, group, *, decode=False,
                  uniform=False) -> str:
    batch = uniform and not decode and fa4_batch(rows, requests, max_q, tuning.flash_attn)
    tile = fa4_tile(facts.major, spec.head_dim, spec.v_head_dim, spec.dtype, max_q, group,
                    tuning.flash_attn, batch=batch)
    text = Kernel.FA4.value + (", batch mode" if batch else ", varlen")
    text += f", tile {tile.rows}x{tile.keys}" if tile is not None else ", FA4's own tile"
    if decode and facts.major == 9:
        text += " (no split-KV on sm90)"
    return text

def explain_mla(backend: str, spec, facts: DeviceFacts, step: StepShape, tuning: Tuning,
                fa4_usable: bool, flashinfer_usable: bool = False,
                fa3_usable: bool = False) -> list[str]:
    """The MLA step split of ``step`` and each form's kernel, as the builder would plan it."""
    t = tuning.mla
    groups = list(step.groups)
    cut = next((i for i, (_, _, q) in enumerate(groups) if q > t.absorbed_max_query_len),
               len(groups))
    absorbed, mha = groups[:cut], groups[cut:]
    lines = []
    if absorbed:
        requests = sum(n for n, _, _ in absorbed)
        rows = sum(n * q for n, _, q in absorbed)
        line = f"absorbed form: {requests} request(s), {rows} row(s) over the latent cache"
        max_q, max_seq = max(q for _, _, q in absorbed), max(s for _, s, _ in absorbed)
        kernel = {"FLASHINFER_MLA": flashinfer_mla_kernel(facts.capability or (0, 0),
                                                          spec.kv_lora_rank),
                  "TRITON_MLA": Kernel.TRITON_MLA}.get(backend)
        if backend == "COMPOSITE_MLA_SM90":
            route = mla_absorbed_route(spec.num_heads, requests, max_q, max_seq, t, fa3_usable)
            kernel, line = route.kernel, f"{line} -- route: {route.why}"
        if kernel is Kernel.TRITON_MLA:
            launch = mla_decode_launch(spec.num_heads, requests, max_q, max_seq, facts.num_sms, t)
            line += (f" -- TRITON_MLA kernel, {launch.splits} split(s) of each request's keys, "
                     f"{launch.query_rows} query x {launch.heads} head rows a program, "
                     f"{launch.keys} keys a step")
        elif kernel is not None:
            line += f" -- {kernel.value}"
        lines.append(line)
    if mha:
        new = sum(n * q for n, _, q in mha)
        context = sum(n * (s - q) for n, s, q in mha)
        chunks = -(-context // t.context_chunk_tokens)
        kernel = (mla_prefill_kernel(fa4_usable, flashinfer_usable, sum(n for n, _, _ in mha),
                                     t.flashinfer_prefill_max_requests).value
                  if backend != "REFERENCE_MLA" else f"{backend}'s")
        lines.append(f"MHA form: {sum(n for n, _, _ in mha)} request(s), {new} new token(s) on "
                     f"{kernel}; {context} context row(s) in {chunks} chunk(s) of at most "
                     f"{t.context_chunk_tokens}, merged through the LSE")
    return lines
