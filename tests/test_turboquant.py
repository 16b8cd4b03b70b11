"""TurboQuant KV: vLLM's format byte for byte (an independent re-statement of its rules is the
oracle), its codebooks and rotation, the round-trip error the format gives, the cache write's
serving rules, attention over the quantized cache against REFERENCE over the same keys and
values read back, the spec's and the selector's answers, opcheck and compile."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attn_ops import (Attention, AttentionConfig, AttentionSpec, BlockAllocator, build_batch,
                      select_backend)
from attn_ops.backends.turboquant import format as tq
from attn_ops.backends.turboquant.backend import boundary_layers
from attn_ops.backends.turboquant.ops import (turboquant_attention, turboquant_cache_update,
                                              turboquant_dense_cache)
from attn_ops.platforms import Platform
from attn_ops.selector import BackendNotSupportedError
from attn_ops.spec import TURBOQUANT_KV_DTYPES, KVCacheDType

PRESETS = sorted(TURBOQUANT_KV_DTYPES, key=lambda d: d.value)
# vLLM 0.26's centroids times sqrt(head_dim), the positive half (its Lloyd-Max procedure;
# equal to 4 decimals at head dims 64, 128 and 256)
VLLM_CENTROIDS = {3: (0.2450, 0.7556, 1.3432, 2.1503),
                  4: (0.1284, 0.3881, 0.6569, 0.9424, 1.2563, 1.6179, 2.0684, 2.7309)}
# vLLM's slot bytes at head dims 64 / 128 / 256
VLLM_SLOTS = {KVCacheDType.TURBOQUANT_K8V4: (100, 196, 388),
              KVCacheDType.TURBOQUANT_4BIT_NC: (70, 134, 262),
              KVCacheDType.TURBOQUANT_K3V4_NC: (62, 118, 230),
              KVCacheDType.TURBOQUANT_3BIT_NC: (54, 102, 198)}


@pytest.mark.parametrize("d", [64, 128, 256])
def test_codebooks_are_vllms(d):
    for bits, half in VLLM_CENTROIDS.items():
        c = tq.lloyd_max_centroids(d, bits)
        assert list(c) == sorted(c) and len(c) == 2 ** bits
        assert np.allclose(np.array(c[len(c) // 2:]) * math.sqrt(d), half, atol=5e-5)
        assert np.allclose(c, [-x for x in reversed(c)], atol=1e-7)


def test_codebooks_and_rotation_are_made_once_a_device():
    """A write or read asks for them every call: made again, each would copy from the host
    (a device sync, and a failure under CUDA-graph capture)."""
    for bits in (3, 4):
        first = tq.codebook(128, bits, "cpu")
        assert all(a is b for a, b in zip(first, tq.codebook(128, bits, torch.device("cpu"))))
    assert tq.hadamard(64, "cpu") is tq.hadamard(64)


def test_hadamard_is_sylvesters_orthonormal_and_its_own_inverse():
    h = tq.hadamard(8)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(8), atol=1e-6, rtol=0)
    assert torch.equal(torch.sign(h[1]), torch.tensor([1., -1.] * 4))  # (no random signs)
    with pytest.raises(ValueError, match="head_dim=48"):
        tq.hadamard(48)


def test_slot_sizes_are_vllms():
    for dtype, sizes in VLLM_SLOTS.items():
        assert tuple(tq.slot_bytes(dtype, d) for d in (64, 128, 256)) == sizes


@pytest.mark.parametrize("bits", [3, 4])
def test_bit_streams_are_lsb_first(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (5, 32), generator=g)
    packed = tq.pack_bits(codes, bits)
    assert packed.shape == (5, 32 * bits // 8)
    assert torch.equal(tq.unpack_bits(packed, bits, 32), codes)
    stream = np.unpackbits(packed.numpy(), axis=-1, bitorder="little")  # bit i of the stream
    for d in range(32):
        value = sum(int(stream[0, bits * d + i]) << i for i in range(bits))
        assert value == int(codes[0, d])


def _numpy_slots(key: np.ndarray, value: np.ndarray, preset, d: int) -> list[bytes]:
    """vLLM's store rules restated in numpy and Python ints, one (token, head) at a time."""
    out = []
    h = np.array(tq.hadamard(d), dtype=np.float32)
    for k, v in zip(key.astype(np.float32), value.astype(np.float32)):
        data = bytearray()
        if preset.fp8_keys:
            data += torch.tensor(np.clip(k, -448, 448)).to(torch.float8_e4m3fn).view(
                torch.uint8).numpy().tobytes()
        else:
            n = np.float32(np.sqrt(np.sum(k.astype(np.float64) ** 2)))
            y = (k / (n + np.float32(1e-8))) @ h
            c = np.array(tq.lloyd_max_centroids(d, preset.key_bits), dtype=np.float32)
            mid = (c[:-1] + c[1:]) / np.float32(2)
            idx = [int(np.sum(mid <= yi)) for yi in y]
            data += _pack(idx, preset.key_bits) + np.float16(n).tobytes()
        lo, hi = np.float32(v.min()), np.float32(v.max())
        top = 2 ** preset.value_bits - 1
        s = max(np.float32((hi - lo) / np.float32(top)), np.float32(1e-8))
        codes = [int(min(max(np.floor((x - lo) / s + np.float32(0.5)), 0), top)) for x in v]
        data += _pack(codes, preset.value_bits) + np.float16(s).tobytes() + \
            np.float16(lo).tobytes()
        out.append(bytes(data + b"\0" * (len(data) % 2)))
    return out


def _pack(codes, bits) -> bytes:
    stream = 0
    for i, c in enumerate(codes):
        stream |= c << (bits * i)
    return stream.to_bytes(len(codes) * bits // 8, "little")


@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
@pytest.mark.parametrize("d", [64, 128])
def test_slots_are_the_bytes_vllms_rules_give(dtype, d):
    """Every byte of every slot as the re-stated rules write it -- but a key index where the
    rotated coordinate sits within 1e-6 of a codebook midpoint (the matmul's summation order
    may put it on either side), and the byte holding it."""
    preset = tq.PRESETS[dtype]
    g = torch.Generator().manual_seed(d)
    key = torch.randn(64, d, generator=g) * torch.linspace(0.1, 3.0, d)
    key[:, 5] *= 20  # (an outlier channel)
    value = torch.randn(64, d, generator=g)
    got = tq.quantize_slots(key, value, preset)
    assert got.dtype == torch.uint8 and got.shape == (64, preset.slot_bytes(d))
    want = _numpy_slots(key.numpy(), value.numpy(), preset, d)
    for t in range(64):
        w = torch.tensor(list(want[t]), dtype=torch.uint8)
        differ = set((got[t] != w).nonzero().flatten().tolist())
        assert not differ - _bytes_at_midpoints(key[t], preset, d), \
            f"token {t}: bytes {differ} differ"


def _bytes_at_midpoints(key: torch.Tensor, preset, d: int) -> set[int]:
    """The slot bytes holding a key index whose rotated coordinate sits within 1e-6 of a
    codebook midpoint, and the fp16 norm's two bytes where the norm sits within 1e-6 of an
    fp16 rounding tie: fp32 products summed in another order may put either on either side
    (none for fp8 keys)."""
    if preset.fp8_keys:
        return set()
    c = torch.tensor(tq.lloyd_max_centroids(d, preset.key_bits))
    mid = (c[:-1] + c[1:]) / 2
    key = key.double()
    norm = key.norm()
    y = (key / (norm + 1e-8) @ tq.hadamard(d).double()).float()
    close = ((y[:, None] - mid).abs() < 1e-6).any(1).nonzero().flatten().tolist()
    bits = preset.key_bits
    out = {i * bits // 8 for i in close} | {(i * bits + bits - 1) // 8 for i in close}
    if (norm * (1 - 1e-6)).half() != (norm * (1 + 1e-6)).half():
        out |= {d * bits // 8, d * bits // 8 + 1}
    return out


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_code_lookup_counts_the_midpoints_at_or_below(d, bits):
    """The CUDA write's one-read key codes (``format.code_lookup``): a coordinate on the grid
    ``u = y S + A`` (fp32, as the kernel computes it) read from cell ``round(u)`` (ties to
    even, as the add of 1.5 2^23 rounds) gives ``count + (u >= threshold)``: the count of
    midpoints at or below it on the grid, for coordinates across [-1, 1], on every midpoint, an
    fp32 step either side of one, and on the cells' edges; and so the torch write's
    ``searchsorted(right=True)`` but within 1e-6 of a midpoint (where fp32 sums in another
    order may go either way too)."""
    cells, scale, offset = tq.code_lookup(d, bits)
    _, mid = tq.codebook(d, bits)
    assert math.log2(scale).is_integer() and cells.shape[0] == 2 * offset + 1
    g = torch.Generator().manual_seed(d + bits)
    edges = ((torch.arange(int(2 * offset) + 1) - offset + 0.5) / scale).float()
    y = torch.cat([torch.rand(20000, generator=g) * 2 - 1, mid, mid.nextafter(mid - 1),
                   mid.nextafter(mid + 1), edges, torch.tensor([-1.0, 1.0, 0.0])])
    u = y * scale + offset  # (y S exact: S is a power of two; one rounding, as the FMA's)
    cell = torch.round(u).long().clamp(0, cells.shape[0] - 1)
    code = (cells.view(torch.int32)[:, 1][cell] + (u >= cells[:, 0][cell]).int()).long()
    on_grid = (u[:, None] >= (mid.double() * scale + offset).float()[None, :]).sum(1)
    torch.testing.assert_close(code, on_grid, rtol=0, atol=0)
    far = ((y[:, None] - mid[None, :]).abs() > 1e-6).all(1) | torch.isin(y, mid)
    torch.testing.assert_close(code[far], torch.searchsorted(mid, y, right=True)[far], rtol=0,
                               atol=0)


def test_round_trip_error_is_the_formats():
    """Relative MSE of keys read back from their slots, head dim 128, Gaussian keys with four
    outlier channels: ~0.0086 at 4 bits and ~0.031 at 3 bits (norm correction changes it by
    under 2%); fp8 keys far below; 4-bit values ~0.01, 3-bit ~0.046."""
    g = torch.Generator().manual_seed(0)
    key = torch.randn(4096, 128, generator=g)
    key[:, [3, 17, 64, 100]] *= 8
    value = torch.randn(4096, 128, generator=g)
    want = {KVCacheDType.TURBOQUANT_K8V4: (0.0, 0.002, 0.0100),
            KVCacheDType.TURBOQUANT_4BIT_NC: (0.0075, 0.0095, 0.0100),
            KVCacheDType.TURBOQUANT_K3V4_NC: (0.028, 0.034, 0.0100),
            KVCacheDType.TURBOQUANT_3BIT_NC: (0.028, 0.034, 0.0458)}
    for dtype, (low, high, value_err) in want.items():
        preset = tq.PRESETS[dtype]
        k, v = tq.dequantize_slots(tq.quantize_slots(key, value, preset), preset, 128)
        key_err = ((k - key) ** 2).sum() / (key ** 2).sum()
        assert low <= key_err <= high, (dtype, key_err)
        assert abs(((v - value) ** 2).sum() / (value ** 2).sum() - value_err) < 0.1 * value_err


def test_values_read_back_with_the_stored_fp16_scale_and_minimum():
    preset = tq.PRESETS[KVCacheDType.TURBOQUANT_4BIT_NC]
    value = torch.linspace(-1.3, 2.7, 64)[None]
    slots = tq.quantize_slots(torch.randn(1, 64), value, preset)
    _, v = tq.dequantize_slots(slots, preset, 64)
    s = torch.tensor((2.7 + 1.3) / 15).half().float()
    lo = torch.tensor(-1.3).half().float()
    codes = torch.floor((value - value.min()) / ((value.max() - value.min()) / 15) + 0.5)
    torch.testing.assert_close(v, codes * s + lo, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
def test_cache_write_skips_padding_and_foreign_slots_and_clears_entered_pages(dtype):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         kv_cache_dtype=dtype)
    from attn_ops.kv_cache import allocate_kv_cache

    cache = allocate_kv_cache(spec, 6, 4)
    cache.fill_(0xFF)  # (what an earlier request left: reads as NaN)
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    slots = torch.tensor([8, 9, 10, -1, 999])  # (block 2 entered at row 0; padding; outside)
    turboquant_cache_update(key, value, cache, slots, dtype.value)
    want = tq.quantize_slots(key, value, tq.PRESETS[dtype])
    for t, s in ((0, 8), (1, 9), (2, 10)):
        assert torch.equal(cache[s // 4, :, s % 4], want[t])
    assert (cache[2, :, 3] == 0).all()  # (the entered page's unfilled row: zero K and V)
    k, v = turboquant_dense_cache(cache, dtype.value, 16)[2].unbind(0)
    assert k[3].eq(0).all() and v[3].eq(0).all()
    assert (cache[[0, 1, 3, 4, 5]] == 0xFF).all()  # (no other page touched)


def _step(spec, ctx, new, seed=0, device="cpu"):
    """A layer, its NaN-poisoned cache with the requests' contexts ``ctx`` written, the step's
    metadata for ``new`` tokens each, and its query, keys and values."""
    layer = Attention(spec, platform=Platform.parse("cpu"))
    alloc = BlockAllocator(64, layer.block_size, shuffle=True, seed=seed)
    cache = layer.allocate_kv_cache(64, device)
    cache.fill_(0xFF)
    g = torch.Generator().manual_seed(seed)
    total = sum(ctx) + sum(new)
    k, v = (torch.randn(total, spec.kv_heads, spec.head_dim, generator=g).to(spec.dtype)
            .to(device) for _ in range(2))
    ids = list(range(len(ctx)))
    at = np.concatenate([[0], np.cumsum(np.array(ctx) + np.array(new))])
    for i, c in enumerate(ctx):  # (the contexts, written by earlier steps)
        pre = build_batch(alloc, [i], [0], [c], device=device)
        turboquant_cache_update(k[at[i]:at[i] + c], v[at[i]:at[i] + c], cache,
                                pre.slot_mapping, spec.kv_cache_dtype.value)
    meta = build_batch(alloc, ids, ctx, new, device=device)
    rows = torch.cat([torch.arange(at[i] + c, at[i + 1]) for i, c in enumerate(ctx)])
    q = torch.randn(sum(new), spec.num_heads, spec.head_dim, generator=g).to(spec.dtype)
    return layer, cache, meta, q.to(device), k[rows.to(device)], v[rows.to(device)]


@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
def test_attention_is_reference_over_the_keys_and_values_the_cache_holds(dtype):
    """A mixed step (decodes over contexts in NaN-poisoned, permuted pages, a prefill, a
    chunked-prefill continuation) through the layer: the new tokens written quantized, then
    attention equal to REFERENCE in fp64 over the cache read back in fp64; LSE too."""
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         kv_cache_dtype=dtype)
    layer, cache, meta, q, k, v = _step(spec, [9, 30, 0, 7], [1, 1, 12, 5])
    out, lse = layer(q, k, v, cache, meta, return_lse=True)
    dense = turboquant_dense_cache(cache, dtype.value, 16, torch.float64)
    ref = Attention(spec.with_(kv_cache_dtype="auto", dtype=torch.float64),
                    platform=Platform.parse("cpu"))
    want, want_lse = ref(q.double(), None, None, dense, meta, return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-5, rtol=1e-5)


def test_specs_outside_the_formats_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="power-of-two head_dim, got 96"):
        AttentionSpec(num_heads=4, head_dim=96, kv_cache_dtype="turboquant_4bit_nc")
    AttentionSpec(num_heads=4, head_dim=96, kv_cache_dtype="turboquant_k8v4")  # (no rotation)
    with pytest.raises(ValueError, match="head_dim_v=64"):
        AttentionSpec(num_heads=4, head_dim=128, head_dim_v=64,
                      kv_cache_dtype="turboquant_k8v4")
    with pytest.raises(ValueError, match="MLA spec caches a latent"):
        AttentionSpec.mla(16, kv_cache_dtype="turboquant_4bit_nc")


def test_selection_routes_turboquant_caches_and_other_backends_say_why_not():
    spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=128,
                         kv_cache_dtype="turboquant_3bit_nc")
    h200 = Platform.parse("cuda:9.0")
    for platform in (Platform.parse("cpu"), h200):
        assert select_backend(spec, platform).backend == "TURBOQUANT"
    with pytest.raises(BackendNotSupportedError, match="kv_cache_dtype=turboquant_3bit_nc"):
        select_backend(spec, h200, AttentionConfig(backend="TRITON_ATTN"))
    with pytest.raises(BackendNotSupportedError, match="sliding_window"):
        select_backend(spec.with_(sliding_window=128), h200,
                       AttentionConfig(backend="TURBOQUANT"))


def test_boundary_layers_are_vllms():
    assert boundary_layers(36) == {0, 1, 34, 35}
    assert boundary_layers(3) == {0, 2} and boundary_layers(1) == frozenset()
    assert boundary_layers(48, hybrid=True) == frozenset()


@pytest.mark.parametrize("dtype", [KVCacheDType.TURBOQUANT_4BIT_NC,
                                   KVCacheDType.TURBOQUANT_K8V4], ids=lambda d: d.value)
def test_ops_pass_opcheck(dtype):
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         kv_cache_dtype=dtype)
    layer, cache, meta, q, k, v = _step(spec, [5, 0], [1, 6])
    torch.library.opcheck(turboquant_cache_update, (k, v, cache, meta.slot_mapping,
                                                    dtype.value))
    out = torch.empty(q.shape[0], 4, 16)
    lse = torch.empty(q.shape[0], 4)
    args = layer.impl.op_arguments(q, cache, layer.impl.build_metadata(meta), out, lse=lse)
    torch.library.opcheck(turboquant_attention, args)


def test_the_layer_compiles_fullgraph():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         kv_cache_dtype="turboquant_k3v4_nc")
    layer, cache, meta, q, k, v = _step(spec, [5, 0], [1, 6])
    eager_cache = cache.clone()
    want = layer(q, k, v, eager_cache, meta)
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(q, k, v, cache, meta)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(cache, eager_cache)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
@pytest.mark.parametrize("d", [16, 64, 96])
def test_triton_write_gives_the_torch_writes_bytes(dtype, d, rope):
    """The one-launch Triton write against the torch write, byte for byte (but a key index at a
    codebook midpoint, which fp32 summation order decides), on a step of several requests
    entering pages (tails cleared), padding and a slot outside the cache, over a cache of 0xFF
    bytes; head dim 96 for k8v4 (no rotation: any even dim); with RoPE applied to the keys in
    the same launch. fp8 keys are compared on the GPU only: the interpreter's fp32 -> e4m3
    conversion is wrong (0.4845 -> 0.25); there the inputs are fp16, not bf16 (its fp32 ->
    bf16 conversion truncates)."""
    if d == 96 and dtype is not KVCacheDType.TURBOQUANT_K8V4:
        pytest.skip("rotated presets: power-of-two head dims")
    # (a padding row inside a page's run: rows after it still written, the gap cleared)
    slots = [8, -1, 10, 11, 999, 12, 13, 14, 15, 16, 17, 3, -1, -1]
    _write_against_torch(dtype, d, rope, slots, blocks=6, page=4)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("dtype,d", [(KVCacheDType.TURBOQUANT_4BIT_NC, 128),
                                     (KVCacheDType.TURBOQUANT_3BIT_NC, 64),
                                     (KVCacheDType.TURBOQUANT_K3V4_NC, 16)],
                         ids=["4bit_nc-128", "3bit_nc-64", "k3v4_nc-16"])
def test_triton_write_rotates_by_the_product_as_by_butterflies(dtype, d):
    """The write's Hadamard rotation as the +-1 product on the tensor cores
    (``triton.turboquant_write_fwht=false``; the butterflies are the default the tests above
    run): the torch write's bytes, but a key index at a codebook midpoint, with RoPE, over head
    dims 16 to 128."""
    from attn_ops.backends.turboquant.write_kernels import cache_write_triton

    slots = [8, -1, 10, 11, 999, 12, 13, 14, 15, 16, 17, 3, -1, -1]

    def product(key, value, cache, slots, preset, cos_sin):
        cache_write_triton(key, value, cache, slots, preset, cos_sin, fwht=False)

    _write_against_torch(dtype, d, True, slots, blocks=6, page=4, writer=product)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
@pytest.mark.parametrize("d", [16, 64])
def test_triton_write_reads_codes_from_cells(dtype, d):
    """The Triton write computing as the CUDA write does (``triton.turboquant_write_lookup``:
    the raw key rotated, key codes from ``format.code_lookup``'s cells, values by a
    reciprocal and Markstein steps): the torch write's bytes but a key index at a midpoint,
    with RoPE, entering pages, padding and a slot outside the cache; then 256 tokens' values
    (every value code as torch's division gives it)."""
    from attn_ops.backends.turboquant.write_kernels import cache_write_triton

    def lookup(key, value, cache, slots, preset, cos_sin):
        cache_write_triton(key, value, cache, slots, preset, cos_sin, lookup=True)

    slots = [8, -1, 10, 11, 999, 12, 13, 14, 15, 16, 17, 3, -1, -1]
    _write_against_torch(dtype, d, True, slots, blocks=6, page=4, writer=lookup)
    _write_against_torch(dtype, d, False, list(range(256)), blocks=16, page=16, writer=lookup)
    _values_at_ties_as_torch(dtype, d, lookup)


def _values_at_ties_as_torch(dtype, d, writer):
    """``writer``'s value bytes equal the torch write's for fp32 values a few ulps from a code's
    rounding tie (``(v - lo) / s`` near ``k + 0.5``), where a quotient off by an ulp takes the
    other code: one in twenty of them without the division's correction steps."""
    preset = tq.PRESETS[dtype]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(d)
    t, top = 64, 2 ** preset.value_bits - 1
    span = torch.rand(t, 2, 1, generator=g) * 8 + 0.5
    step = (span / top).float()
    code = torch.randint(0, top, (t, 2, d), generator=g)
    value = ((code + 0.5) * step.double()).float()
    value += torch.randint(-2, 3, value.shape, generator=g) * (value.nextafter(value + 1) - value)
    value[..., 0], value[..., 1] = 0.0, span[..., 0]  # (each row's minimum and maximum)
    key = torch.randn(t, 2, d, generator=g)
    slots = torch.arange(t)
    want = torch.zeros(t // 16, 2, 16, preset.slot_bytes(d), dtype=torch.uint8)
    turboquant_cache_update(key, value, want, slots, dtype.value, None)  # (the torch body)
    got = torch.zeros_like(want).to(dev)
    writer(key.to(dev), value.to(dev), got, slots.to(dev), preset, None)
    kb = preset.key_bytes(d)
    assert torch.equal(got.cpu()[..., kb:], want[..., kb:])


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
def test_triton_write_clears_long_pages_across_programs(dtype):
    """As above at page 128: a prefill of 100 tokens entering a page (seven programs of 16
    tokens; a padding row at row 80, its gap and the tail past row 99 seen only in the second
    tile of 64 rows the following tokens' slots are read in), a decode entering a page (127
    rows cleared, in tiles of 32 rows: head dim 64 gives slots of 65 to 128 bytes), tokens
    inside a page, a slot outside."""
    run = [128 + i for i in range(100)]
    run[80] = -1
    slots = [*run, 256, 70, 71, 999]
    _write_against_torch(dtype, 64, False, slots, blocks=3, page=128)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("dtype", [KVCacheDType.TURBOQUANT_4BIT_NC,
                                   KVCacheDType.TURBOQUANT_3BIT_NC], ids=lambda d: d.value)
def test_triton_write_finds_codes_by_search_as_by_count(dtype):
    """Key codes by a binary search over the midpoints (``triton.turboquant_write_search``):
    the very bytes the count of midpoints gives, every key index included."""
    from attn_ops.backends.turboquant.write_kernels import cache_write_triton

    preset, dev = tq.PRESETS[dtype], "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    key, value = (torch.randn(40, 2, 32, generator=g).to(torch.float16).to(dev)
                  for _ in range(2))
    key[:, :, 3] *= 8  # (an outlier channel: codes at both ends of the codebook)
    slots = torch.randperm(48, generator=g)[:40].to(dev)
    caches = []
    for search in (False, True):
        cache = torch.full((12, 2, 4, preset.slot_bytes(32)), 0xFF, dtype=torch.uint8,
                           device=dev)
        cache_write_triton(key, value, cache, slots, preset, search=search)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA write needs a GPU")
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
def test_cuda_write_gives_the_torch_writes_bytes(dtype, d, rope):
    """The CUDA write (``triton.turboquant_cuda_write``) against the torch write, byte for
    byte but a key index at a codebook midpoint: every preset, head dims 64 / 128 / 256, with
    and without RoPE, on a step of requests entering pages of 4 (tails cleared), padding and a
    slot outside the cache; then a prefill entering a page of 128 and a decode entering one;
    then a 1024-token prefill, and fp32 values at codes' rounding ties. Keys whose rows are not
    16-byte aligned pieces, and a cache at an odd address, are refused."""
    from attn_ops.backends.turboquant.cuda_write import (cuda_write_built, cuda_write_serves,
                                                         turboquant_cuda_write)

    assert cuda_write_built()

    def write(key, value, cache, slots, preset, cos_sin):
        assert cuda_write_serves(key, value, cache, slots, preset, cos_sin)
        turboquant_cuda_write(key, value, cache, slots, preset, cos_sin)

    slots = [8, -1, 10, 11, 999, 12, 13, 14, 15, 16, 17, 3, -1, -1]
    _write_against_torch(dtype, d, rope, slots, blocks=6, page=4, writer=write)
    run = [128 + i for i in range(100)]
    run[80] = -1
    _write_against_torch(dtype, d, rope, [*run, 256, 70, 71, 999], blocks=3, page=128,
                                writer=write)
    # (a prefill of 1024 tokens; fp32 values at rounding ties, divided as torch divides)
    _write_against_torch(dtype, d, rope, list(range(1024)), blocks=64, page=16, writer=write)
    _values_at_ties_as_torch(dtype, d, write)
    # rows not in 16-byte pieces are not its to serve (the Triton write takes them)
    key = torch.randn(4, 2, d + 1, device="cuda", dtype=torch.bfloat16)[..., 1:]
    value = torch.randn(4, 2, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, 16, tq.PRESETS[dtype].slot_bytes(d), dtype=torch.uint8,
                        device="cuda")
    slots = torch.arange(4, device="cuda")
    assert not cuda_write_serves(key, value, cache, slots, tq.PRESETS[dtype])
    assert cuda_write_serves(key.contiguous(), value, cache, slots, tq.PRESETS[dtype])
    odd = torch.zeros(cache.numel() + 1, dtype=torch.uint8, device="cuda")[1:].view(cache.shape)
    assert not cuda_write_serves(key.contiguous(), value, odd, slots, tq.PRESETS[dtype])


def _write_against_torch(dtype, d, rope, slots, blocks, page, writer=None):
    """The Triton write (``writer``: another with its arguments) of ``len(slots)`` tokens (2
    KV heads of ``d``) into a cache of 0xFF bytes (``blocks`` pages of ``page``) equals the
    torch write byte for byte, but a key index at a codebook midpoint."""
    from attn_ops.backends.turboquant.write_kernels import cache_write_triton
    from attn_ops.glue import _rope_impl

    preset = tq.PRESETS[dtype]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # (fp16 in the interpreter: its fp32 -> bf16 conversion truncates, and the RoPE write
    # rounds the rotated key to the input dtype)
    io = torch.bfloat16 if dev == "cuda" else torch.float16
    t = len(slots)
    g = torch.Generator().manual_seed(d)
    key, value = (torch.randn(t, 2, d, generator=g).to(io).to(dev) for _ in range(2))
    slots = torch.tensor(slots).to(dev)
    cache = torch.full((blocks, 2, page, preset.slot_bytes(d)), 0xFF, dtype=torch.uint8,
                       device=dev)
    cos_sin = None
    if rope:
        from attn_ops.models.llama import rope_cache

        cos_sin = rope_cache(d, 64, 10000.0)[torch.randint(64, (t,), generator=g)].to(dev)
    want = cache.cpu().clone()  # (a copy: on the CPU .cpu() is the cache itself)
    turboquant_cache_update(key.cpu(), value.cpu(), want, slots.cpu(), dtype.value,
                            cos_sin.cpu() if rope else None)  # (the torch body)
    (writer or cache_write_triton)(key, value, cache, slots, preset, cos_sin)
    got = cache.cpu()
    if preset.fp8_keys and dev == "cpu":
        got, want = got[..., d:], want[..., d:]
    rotated = _rope_impl(key.cpu(), cos_sin.cpu()) if rope else key.cpu()
    written = slots.cpu().tolist()
    for block, head, row, byte in (got != want).nonzero().tolist():
        assert block * page + row in written, ("a slot no token writes", block, head, row, byte)
        i = written.index(block * page + row)
        assert byte in _bytes_at_midpoints(rotated[i, head].float(), preset, d), \
            (block, head, row, byte)


def _triton_and_torch_body(spec, cache, meta, q, triton: dict):
    """TRITON_ATTN's kernels over the TurboQuant ``cache`` (under the ``Tuning.triton`` fields
    ``triton``) and the torch body on a CPU copy of the same arguments: ``(plan, out, lse,
    torch body's out, its lse)``, the outputs NaN before the launches."""
    from attn_ops.backends.turboquant.backend import TurboQuantBackend
    from attn_ops.backends.turboquant.ops import triton_turboquant_attention
    from attn_ops.tuning import default_tuning

    impl = TurboQuantBackend(spec, tuning=default_tuning().with_(triton=triton))
    plan = impl.build_metadata(meta)
    out = torch.full((q.shape[0], spec.num_heads, spec.head_dim), float("nan"),
                     dtype=spec.dtype, device=q.device)
    lse = torch.full((q.shape[0], spec.num_heads), float("nan"), device=q.device)
    args = impl.op_arguments(q, cache, plan, out, lse=lse)
    want = [a.cpu().clone() if torch.is_tensor(a) else a for a in args]
    turboquant_attention(*want)  # (the torch body: on the CPU)
    triton_turboquant_attention(*args)
    return plan, out, lse, want[6], want[7]


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("route,case", [
    *((route, "d16") for route in ("one_split", "splits", "fused_splits")),
    ("fused_splits", "d64"), ("splits", "d64_fp16"), ("one_split", "d64_fp16_unaligned"),
    ("fused_splits", "d64_bf16"),
    ("one_split", "d64_planes"), ("splits", "d64_fp16_planes"),
    ("fused_splits", "d64_fp16_unaligned_planes"), ("one_split", "d16_coalesced"),
    ("splits", "d64_fp16_coalesced"), ("fused_splits", "d64_unaligned_coalesced"),
    ("splits", "d64_fp16_planes_coalesced")])
@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
def test_triton_attention_reads_the_slots_as_the_torch_body_does(dtype, route, case):
    """TRITON_ATTN's kernels reading the TurboQuant format (the rotated query, codes unpacked
    in registers, norm correction, values from their fp16 scale and minimum) against the torch
    body on the same cache: a mixed step -- decodes over NaN-poisoned permuted pages, a prefill,
    a chunked-prefill continuation, a 1-token request -- whole and with its decodes' keys split
    (combined in a second launch, or by the last split), LSE too; head dim 16 in padded tiles,
    64 in fp16 and bf16 (tensor-core products of the decoded tiles on GPUs) and from a cache 2
    bytes into its buffer; ``planes`` / ``coalesced``: 4-bit fields read as nibble planes,
    codes gathered along a slot's bytes (``Tuning.triton.turboquant_*``; both: the defaults);
    fp32 products are exact."""
    from attn_ops.backends.triton_attn import PLAN

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if "bf16" in case and dev == "cpu":
        pytest.skip("GPU only: Triton's interpreter computes bf16 tl.dot products wrong")
    head_dim = 16 if case.startswith("d16") else 64
    dtype_ = torch.float16 if "fp16" in case else torch.bfloat16 if "bf16" in case else \
        torch.float32
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=head_dim, dtype=dtype_,
                         kv_cache_dtype=dtype)
    _, cache, meta, q, k, v = _step(spec, [9, 30, 0, 0, 7], [1, 1, 1, 12, 5], device=dev)
    if "unaligned" in case:  # the same cache 2 bytes into a buffer
        buffer = torch.empty(cache.numel() + 2, dtype=torch.uint8, device=dev)
        buffer[2:].copy_(cache.flatten())
        cache = buffer[2:].view(cache.shape)
    turboquant_cache_update(k, v, cache, meta.slot_mapping, dtype.value)
    triton = {"one_split": dict(max_splits=1),
              "splits": dict(min_keys_per_split=4, programs_per_sm=64, fused_combine=False),
              "fused_splits": dict(min_keys_per_split=4, programs_per_sm=64,
                                   fused_combine=True)}[route]
    triton.update(turboquant_planes="planes" in case, turboquant_coalesced="coalesced" in case)
    plan, out, lse, want, want_lse = _triton_and_torch_body(spec, cache, meta, q, triton)
    assert PLAN.decode(plan.plan).turboquant_planes == ("planes" in case)
    if route != "one_split":
        assert PLAN.decode(plan.plan).splits > 1
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype_, 2e-6)
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get(
    "TRITON_INTERPRET") != "1", reason="Triton needs a GPU or its interpreter")
@pytest.mark.parametrize("dtype", PRESETS, ids=lambda d: d.value)
def test_triton_attention_reads_random_steps_as_the_torch_body_does(dtype):
    """TRITON_ATTN over the TurboQuant format on a step drawn at random (seeded by the preset):
    GQA group, request count, contexts and query lengths (decodes first), the split route and
    the field reads -- against the torch body on the same cache, LSE too."""
    import random

    rng = random.Random(dtype.value)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv, group = rng.randint(1, 3), rng.choice([1, 3, 4])
    b = rng.randint(1, 5)
    new = sorted((rng.choice([1, 1, rng.randint(2, 20)]) for _ in range(b)), key=lambda n: n > 1)
    ctx = [rng.choice([0, rng.randint(1, 40)]) for _ in range(b)]
    spec = AttentionSpec(num_heads=kv * group, num_kv_heads=kv, head_dim=16,
                         dtype=torch.float32, kv_cache_dtype=dtype)
    _, cache, meta, q, k, v = _step(spec, ctx, new, seed=len(dtype.value), device=dev)
    turboquant_cache_update(k, v, cache, meta.slot_mapping, dtype.value)
    triton = rng.choice([dict(max_splits=1),
                         dict(min_keys_per_split=rng.choice([2, 4]), programs_per_sm=64,
                              fused_combine=rng.random() < 0.5)])
    triton.update(turboquant_planes=rng.random() < 0.5, turboquant_coalesced=rng.random() < 0.5)
    _, out, lse, want, want_lse = _triton_and_torch_body(spec, cache, meta, q, triton)
    torch.testing.assert_close(out.cpu(), want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-6, rtol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [KVCacheDType.TURBOQUANT_4BIT_NC, KVCacheDType.TURBOQUANT_K8V4,
                                   KVCacheDType.TURBOQUANT_3BIT_NC], ids=lambda d: d.value)
def test_graph_replays_of_random_decode_batches_match_eager(dtype):
    """Decode steps captured once per size (1, 4, 16 requests; Llama-3-8B's heads, bf16) and
    replayed over 200 random batches -- lengths, pages and queries new each time, padded to
    the next size -- against the eager op on the same batch; every 50th also against the
    torch body (the oracle); padding rows zero."""
    import random

    from attn_ops import build_step_metadata
    from attn_ops.cudagraph import CUDAGraphBatch
    from attn_ops.testing import capture_graph, random_decode_batch

    block, width, sizes = 16, 64, (1, 4, 16)
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                         kv_cache_dtype=dtype, block_size=block)
    layer = Attention(spec).cuda()
    num_blocks = sizes[-1] * width + 1
    cache = layer.allocate_kv_cache(num_blocks)
    gen = torch.Generator(device="cuda").manual_seed(5)
    slots = torch.arange(num_blocks * block, device="cuda")
    k, v = (torch.randn(slots.shape[0], 8, 128, generator=gen, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    turboquant_cache_update(k, v, cache, slots, dtype.value)
    graphs = CUDAGraphBatch(sizes, width, block, "cuda")
    q = torch.zeros(sizes[-1], 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    lse = torch.zeros(sizes[-1], 32, device="cuda")
    rng = random.Random(3)
    captured = {}

    def run(size, step):
        layer.impl.forward(q[:size], cache, step[layer._metadata_key], out[:size],
                           lse=lse[:size])

    for size in sizes:
        step = build_step_metadata(layer, random_decode_batch(size, num_blocks, rng, block,
                                                              width * block, device="cuda"),
                                   graphs)
        captured[size], _ = capture_graph(lambda: run(size, step))
    for i in range(200):
        n = rng.randint(1, sizes[-1])
        common = random_decode_batch(n, num_blocks, rng, block, width * block, device="cuda")
        build_step_metadata(layer, common, graphs)
        size = graphs.size_for(n)
        q.normal_(generator=gen)
        captured[size].replay()
        want, want_lse = torch.empty_like(q[:n]), torch.empty_like(lse[:n])
        layer.impl.forward(q[:n].clone(), cache, common, want, lse=want_lse)
        # (bf16 outputs: the eager plan may split the keys otherwise -- an ulp apart)
        torch.testing.assert_close(out[:n], want, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[:n], want_lse, atol=1e-4, rtol=1e-4)
        assert (out[n:size] == 0).all() and (lse[n:size] == 0).all()
        if i % 50 == 0:
            oracle = [a.cpu() if torch.is_tensor(a) else a for a in layer.impl.op_arguments(
                q[:n], cache, layer.impl.build_metadata(common), want.clone(),
                lse=want_lse.clone())]
            turboquant_attention(*oracle)
            torch.testing.assert_close(out[:n].cpu().float(), oracle[6].float(), atol=2e-2,
                                       rtol=2e-2)


def test_a_rope_write_is_the_rotated_keys_write():
    """``cos_sin`` given, the write stores the keys ``torch.ops.attn.rope`` rotates (rounded to
    their dtype), byte for byte; the layer passes it so, rotating the query itself."""
    from attn_ops.glue import rope
    from attn_ops.models.llama import rope_cache

    g = torch.Generator().manual_seed(9)
    key, value = (torch.randn(6, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    cos_sin = rope_cache(32, 16, 10000.0)[torch.randint(16, (6,), generator=g)]
    slots = torch.arange(6)
    fused, plain = (torch.zeros(2, 2, 4, tq.slot_bytes(KVCacheDType.TURBOQUANT_4BIT_NC, 32),
                                dtype=torch.uint8) for _ in range(2))
    turboquant_cache_update(key, value, fused, slots, "turboquant_4bit_nc", cos_sin)
    turboquant_cache_update(rope(key, cos_sin), value, plain, slots, "turboquant_4bit_nc")
    assert torch.equal(fused, plain)
    with pytest.raises(ValueError, match=r"cos_sin must be \[num_tokens=6, head_dim=32\]"):
        turboquant_cache_update(key, value, fused, slots, "turboquant_4bit_nc", cos_sin[:3])
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                         kv_cache_dtype="turboquant_k3v4_nc")
    layer, cache, meta, q, k, v = _step(spec, [5, 0], [1, 6])
    cos_sin = rope_cache(16, 16, 10000.0)[meta.positions]
    rotated_cache = cache.clone()
    got = layer(q, k, v, cache, meta, cos_sin=cos_sin)
    want = layer(rope(q, cos_sin), rope(k, cos_sin), v, rotated_cache, meta)
    assert torch.equal(got, want) and torch.equal(cache, rotated_cache)


def _cuda_decode_step(kv_dtype, d, heads, kv_heads, dtype_, device, rounded=False):
    """A uniform decode step over a ``kv_dtype`` cache (NaN-poisoned, permuted pages; contexts of
    0 to 300 tokens): ``(impl, cache, meta, q, torch body's out, its lse)``; ``rounded``: the
    body's query as the CUDA decode reads it (4-bit keys: rotated, rounded to bf16, rotated
    back; fp8 keys: rounded to fp16)."""
    from attn_ops.backends.turboquant.backend import TurboQuantBackend

    spec = AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=d, dtype=dtype_,
                         kv_cache_dtype=kv_dtype)
    _, cache, meta, q, k, v = _step(spec, [9, 300, 0, 130, 31], [1] * 5, device=device)
    if rounded and kv_dtype != KVCacheDType.TURBOQUANT_K8V4:  # (bf16 queries, as models pass:
        q = q.bfloat16().to(q.dtype)  # the CUDA decode may take them unrotated and rotate them)
    turboquant_cache_update(k, v, cache, meta.slot_mapping, spec.kv_cache_dtype.value)
    impl = TurboQuantBackend(spec)
    plan = impl.build_metadata(meta)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], heads), float("nan"), device=device)
    h = tq.hadamard(d, q.device)
    oracle_q = q if not rounded else q.half().to(q.dtype) \
        if kv_dtype == KVCacheDType.TURBOQUANT_K8V4 else \
        ((q.float() @ h).bfloat16().float() @ h).to(q.dtype)
    want = [a.cpu().clone() if torch.is_tensor(a) else a
            for a in impl.op_arguments(oracle_q, cache, plan, out, lse=lse)]
    turboquant_attention(*want)
    return impl, cache, meta, q, want[6], want[7]


def test_cuda_decode_that_does_not_build_says_why_and_stays_off(monkeypatch, caplog):
    """A machine where the CUDA decode's extension does not build (no nvcc, say): the check
    logs the build's error once, with the setting that skips it, and answers False, so the
    decode steps stay on TRITON_ATTN's kernels; a later check asks nothing again."""
    from attn_ops.backends.turboquant import cuda_decode

    calls = []

    def failing_build(min_blocks=0, norm_mma=False):
        calls.append((min_blocks, norm_mma))
        raise RuntimeError("Ninja is required to load C++ extensions")

    cuda_decode.cuda_decode_built.cache_clear()
    monkeypatch.setattr(cuda_decode, "_module", failing_build)
    try:
        with caplog.at_level("WARNING", logger="attn_ops"):
            assert cuda_decode.cuda_decode_built() is False
            assert cuda_decode.cuda_decode_built() is False
        assert len(calls) == 1
        text = " ".join(r.getMessage() for r in caplog.records)
        assert "RuntimeError: Ninja is required" in text
        assert "triton.turboquant_cuda_decode=false" in text
    finally:
        cuda_decode.cuda_decode_built.cache_clear()


def _emulated_decode(q_in, cache, block_table, seq_lens, codebook, part_out, part_lse, splits,
                     keys, scale, key_bits, value_bits, rotate):
    """``decode_kernels.cu``'s contract in torch: split ``s``'s warp ``w`` of each (row, head)
    attends the keys of ``[s keys, min(seq, (s + 1) keys))`` in its every fourth step of 16,
    its normalized output and natural log-sum-exp (-inf, zeros: no keys) in part ``4 s + w``;
    ``q_in`` rotated (3- and 4-bit keys) unless ``rotate`` (the kernel rotates it then)."""
    d = q_in.shape[2]
    kv_dtype = next(k.value for k, p in tq.PRESETS.items()
                    if (p.key_bits, p.value_bits) == (key_bits, value_bits))
    dense = turboquant_dense_cache(cache, kv_dtype, d, torch.float64)
    # (the dense cache is in the keys' own coordinates: the rotated query -- here, in fp32 and
    # rounded to the query's dtype, where the kernel rotates it -- is rotated back)
    if rotate and key_bits != 8:
        q_in = (q_in.float() @ tq.hadamard(d)).to(q_in.dtype)
    q = q_in.double() if key_bits == 8 else q_in.double() @ tq.hadamard(d).double()
    page, group = cache.shape[2], q.shape[1] // cache.shape[1]
    part_out.zero_()
    part_lse.fill_(float("-inf"))
    for row in range(q.shape[0]):
        seq = int(seq_lens[row])
        pos = torch.arange(seq)
        slots = block_table[row].long()[pos // page] * page + pos % page
        k = dense[:, 0].reshape(-1, *dense.shape[3:])[slots]  # [seq, Hk, D]
        v = dense[:, 1].reshape(-1, *dense.shape[3:])[slots]
        for part in range(splits * 4):
            s, w = divmod(part, 4)
            mine = (pos >= s * keys) & (pos < (s + 1) * keys) & ((pos - s * keys) // 16 % 4 == w)
            if not mine.any():
                continue
            for head in range(q.shape[1]):
                kv = head // group
                logits = (k[mine, kv] @ q[row, head]) * scale
                weights = logits.softmax(0)
                part_out[row, head, part] = (weights @ v[mine, kv]).float()
                part_lse[row, head, part] = logits.logsumexp(0).float()


def _emulated_combine(part_out, part_lse, query_start_loc, out, lse):
    """``tq_combine_kernel``'s contract in torch: the splits merged by their log-sum-exps, rows
    from ``query_start_loc[-1]`` on and rows without keys zero (LSE too)."""
    top = part_lse.amax(-1, keepdim=True)
    top = torch.where(top.isfinite(), top, torch.zeros_like(top))
    weight = (part_lse - top).exp()
    total = weight.sum(-1)
    live = (torch.arange(out.shape[0]) < query_start_loc[-1]).unsqueeze(1) & (total > 0)
    merged = (weight.unsqueeze(-1) * part_out).sum(-2) / total.clamp_min(1e-30).unsqueeze(-1)
    out.copy_(merged * live.unsqueeze(-1))
    if lse is not None:
        lse.copy_(torch.where(live, top.squeeze(-1) + total.clamp_min(1e-30).log(), 0.0))


@pytest.mark.parametrize("kv_dtype", PRESETS, ids=lambda d: d.value)
def test_cuda_decode_merges_its_splits_as_the_torch_body_attends(kv_dtype, monkeypatch):
    """The CUDA decode's glue on the CPU, the kernels emulated by their contracts
    (:func:`_emulated_decode`, :func:`_emulated_combine`), every preset: the query in (rotated,
    in bf16, before the launch or in it; fp8 keys: fp16), every split's partials merged into
    the torch body's output and LSE over the same slots, more splits than keys in short rows,
    a padded row (past ``query_start_loc[-1]``) zero; what it serves."""
    from attn_ops.backends.turboquant import cuda_decode
    from attn_ops.tuning import default_tuning

    impl, cache, meta, q, want, want_lse = _cuda_decode_step(kv_dtype, 128, 8, 2, torch.float32,
                                                             "cpu", rounded=True)
    preset = tq.PRESETS[kv_dtype]
    # (8 CTAs an SM of the CPU's 8 "SMs": 64 at once)
    monkeypatch.setattr(cuda_decode, "_module", lambda *build: type("M", (), {
        "decode": staticmethod(_emulated_decode), "combine": staticmethod(_emulated_combine),
        "blocks_per_sm": staticmethod(lambda *args: 8)}))
    cuda_decode._slots.cache_clear()  # (a device's CTAs, from the emulated build's occupancy)
    tuning = default_tuning().with_(triton=dict(  # (16 keys a warp; the query rotated before)
        turboquant_cuda_split_keys=64, turboquant_cuda_fused_rotation=False))
    out = torch.full_like(q, float("nan"))
    lse = torch.full_like(want_lse, float("nan"))
    codebook = tq.codebook(128, tq.PRESETS[kv_dtype].key_bits % 8 or 4)[0]
    fused = tuning.with_(triton=dict(turboquant_cuda_fused_rotation=True))  # (rotated in it)
    cuda_decode.turboquant_cuda_decode(q, cache, meta.query_start_loc, meta.seq_lens,
                                       meta.block_table, out, lse, impl.scale, preset, codebook,
                                       fused)
    torch.testing.assert_close(out, want.to(out.dtype), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    out.fill_(float("nan"))
    cuda_decode.turboquant_cuda_decode(q, cache, meta.query_start_loc, meta.seq_lens,
                                       meta.block_table, out, lse, impl.scale, preset, codebook,
                                       tuning)
    assert cuda_decode._splits(5, 2, meta.block_table.shape[1] * cache.shape[2], 64, 64)[0] > 1
    # whole waves of an H100's 396 CTAs (3 an SM): 8 and 32 requests of 8 KV heads over 8k
    # keys take 6 and 3 splits (384 and 768 CTAs), one request all 32 of 256 keys
    assert [cuda_decode._splits(b, 8, 8192, 396, 256) for b in (8, 32, 1)] == [
        (6, 1408), (3, 2752), (32, 256)]
    torch.testing.assert_close(out, want.to(out.dtype), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    padded = meta.query_start_loc.clone()
    padded[-1] = 4  # (the last row: padding)
    cuda_decode.turboquant_cuda_decode(q, cache, padded, meta.seq_lens, meta.block_table, out,
                                       lse, impl.scale, preset, codebook, tuning)
    assert (out[4] == 0).all() and (lse[4] == 0).all()
    torch.testing.assert_close(out[:4], want[:4].to(out.dtype), atol=1e-5, rtol=1e-5)
    assert not cuda_decode.cuda_decode_serves(q, cache, meta.seq_lens, preset)  # (a CPU tensor)
    cuda_decode._slots.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA decode kernel needs a GPU")
@pytest.mark.parametrize("dtype_", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (32, 2), (16, 1)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", PRESETS, ids=lambda d: d.value)
def test_cuda_decode_reads_the_slots_as_the_torch_body_does(kv_dtype, d, heads, kv_heads,
                                                            dtype_):
    """``decode_kernels.cu`` (built with nvcc here) against the torch body on the same cache:
    every preset, head dims 64-256, GQA groups of 1 to 16, bf16 and fp16, contexts of 1 to
    301 keys over NaN-poisoned permuted pages; and captured in a CUDA graph, replayed
    equal."""
    from attn_ops.backends.turboquant import cuda_decode

    impl, cache, meta, q, want, want_lse = _cuda_decode_step(kv_dtype, d, heads, kv_heads, dtype_,
                                                             "cuda")
    preset = tq.PRESETS[kv_dtype]
    assert cuda_decode.cuda_decode_serves(q, cache, meta.seq_lens, preset)
    # (pages under 16 positions, a cache off 16-byte alignment or strided: the Triton read)
    assert not cuda_decode.cuda_decode_serves(q, cache[::2], meta.seq_lens, preset)
    assert not cuda_decode.cuda_decode_serves(q, cache[:, :, :8], meta.seq_lens, preset)
    shifted = torch.empty(cache.numel() + 2, dtype=cache.dtype, device=cache.device)[2:]
    assert not cuda_decode.cuda_decode_serves(q, shifted.view(cache.shape), meta.seq_lens, preset)
    out = torch.full_like(q, float("nan"))
    lse = torch.full_like(want_lse, float("nan"), device="cuda")
    centroids = tq.codebook(d, preset.key_bits % 8 or 4, q.device)[0]

    def run():
        cuda_decode.turboquant_cuda_decode(q, cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_table, out, lse, impl.scale, preset,
                                           centroids)

    run()
    tol = 2e-2 if dtype_ == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=tol, rtol=tol)
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, first)
