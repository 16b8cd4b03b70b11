"""TurboQuant's KV-cache format, byte for byte as vLLM 0.26 stores it (``TURBOQUANT``,
``--kv-cache-dtype turboquant_*``), so a cache written by one can be read by the other.

The cache of a layer is ``uint8 [num_blocks, num_kv_heads, block_size, slot]``: head-major in a
block (one KV head's ``block_size`` slots contiguous), one ``slot``-byte slot a (token, KV head)::

    [ key part | value part | pad to an even size ]
    key part, MSE presets: [ indices, key_bits a coordinate, LSB-first | ||k|| fp16 ]
    key part, k8v4:        [ k as fp8 e4m3, head_dim bytes (no scale, no rotation) ]
    value part:            [ codes, value_bits a value, LSB-first | scale fp16 | min fp16 ]

Multi-byte fields are little-endian. Bit streams are LSB-first: 4-bit byte ``j`` holds
elements ``2j`` (low nibble) and ``2j + 1``; 3-bit element ``d`` sits at bits ``3d .. 3d + 2``
of the stream (groups of 8 in 3 bytes).

Keys (MSE presets), per (token, KV head), in fp32: ``n = ||k||``, ``y = (k / (n + 1e-8)) H``
with ``H`` the Sylvester Hadamard matrix over ``sqrt(head_dim)`` (no random signs), each
coordinate's index = how many of the codebook's midpoints are ``<= y`` (a value on a midpoint
goes up), the norm stored as fp16. The codebook is Lloyd-Max for ``N(0, 1 / head_dim)`` by
vLLM's procedure (:func:`lloyd_max_centroids`). Reading: ``k = n c H`` with ``c`` the indexed
centroids, divided by ``||c||`` first with norm correction (``_nc`` presets).

Values, per (token, KV head): ``lo = min v``, ``s = max((max v - lo) / (2^b - 1), 1e-8)``,
``code = clamp(floor((v - lo) / s + 0.5), 0, 2^b - 1)`` in fp32; ``s`` and ``lo`` stored as
fp16, and reading uses the stored (rounded) ones: ``v = code * s + lo``.

k8v4 keys: ``k`` cast to e4m3 with saturation at +-448 (vLLM leaves an overflow to Triton's
cast).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attn_ops.spec import KVCacheDType

__all__ = ["PRESETS", "TurboQuantPreset", "code_lookup", "dequantize_slots", "hadamard",
           "lloyd_max_centroids", "quantize_slots", "slot_bytes"]


@dataclass(frozen=True)
class TurboQuantPreset:
    """A TurboQuant format: key bits (8: fp8 e4m3 keys, unrotated), value bits, and whether
    reading divides the keys' centroid vectors by their norm (norm correction)."""

    key_bits: int
    value_bits: int
    norm_correction: bool

    @property
    def fp8_keys(self) -> bool:
        return self.key_bits == 8

    def key_bytes(self, head_dim: int) -> int:
        return head_dim if self.fp8_keys else -(-head_dim * self.key_bits // 8) + 2

    def value_bytes(self, head_dim: int) -> int:
        return -(-head_dim * self.value_bits // 8) + 4

    def slot_bytes(self, head_dim: int) -> int:
        size = self.key_bytes(head_dim) + self.value_bytes(head_dim)
        return size + size % 2


PRESETS = {
    KVCacheDType.TURBOQUANT_K8V4: TurboQuantPreset(8, 4, False),
    KVCacheDType.TURBOQUANT_4BIT_NC: TurboQuantPreset(4, 4, True),
    KVCacheDType.TURBOQUANT_K3V4_NC: TurboQuantPreset(3, 4, True),
    KVCacheDType.TURBOQUANT_3BIT_NC: TurboQuantPreset(3, 3, True),
}


def slot_bytes(kv_cache_dtype: KVCacheDType, head_dim: int) -> int:
    return PRESETS[kv_cache_dtype].slot_bytes(head_dim)


@functools.cache
def lloyd_max_centroids(head_dim: int, bits: int) -> tuple[float, ...]:
    """The ``2^bits`` Lloyd-Max centroids of ``N(0, 1 / head_dim)``, ascending, as vLLM
    computes them: cells' centres spread evenly over +-3.5 sigma to start, outer edges at
    +-10.5 sigma, each cell's conditional mean by a 200-interval trapezoid rule, until no
    centroid moves by 1e-10 or 200 iterations; rounded to fp32. (The coarse quadrature puts
    them off the textbook Gaussian tables in the 3rd-4th digit: both sides must use these.)"""
    sigma = 1.0 / math.sqrt(head_dim)
    n = 2 ** bits

    def pdf(x):
        return math.exp(-x * x / (2 * sigma * sigma)) / (sigma * math.sqrt(2 * math.pi))

    width = 7 * sigma / n
    c = [-3.5 * sigma + (i + 0.5) * width for i in range(n)]
    for _ in range(200):
        edges = [-10.5 * sigma, *((c[i] + c[i + 1]) / 2 for i in range(n - 1)), 10.5 * sigma]
        new = []
        for i in range(n):
            a, h = edges[i], (edges[i + 1] - edges[i]) / 200
            xs = [a + j * h for j in range(201)]
            w = [pdf(x) * (0.5 if j in (0, 200) else 1.0) for j, x in enumerate(xs)]
            mass = sum(w)
            new.append(sum(wi * x for wi, x in zip(w, xs)) / mass if mass > 0 else c[i])
        moved = max(abs(a - b) for a, b in zip(new, c))
        c = new
        if moved < 1e-10:
            break
    return tuple(float(torch.tensor(x, dtype=torch.float32)) for x in c)


@functools.cache
def _hadamard_cpu(head_dim: int) -> torch.Tensor:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the Sylvester Hadamard rotation needs a power of "
                         "two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(head_dim)).float()


def hadamard(head_dim: int, device=None) -> torch.Tensor:
    """``[head_dim, head_dim]`` fp32: Sylvester's Hadamard matrix over ``sqrt(head_dim)``
    (symmetric and orthonormal: its own inverse); one tensor a device, read-only."""
    return _hadamard_on(head_dim, _device(device))


def codebook(head_dim: int, bits: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centroids [2^bits], midpoints [2^bits - 1])`` in fp32; one pair a device,
    read-only: a write builds none, so it copies nothing from the host -- a copy at every call
    would wait for the device and cannot be captured in a CUDA graph."""
    return _codebook_on(head_dim, bits, _device(device))


def _device(device) -> torch.device:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def code_lookup(head_dim: int, bits: int, device=None) -> tuple[torch.Tensor, float, float]:
    """A key code as one table read: ``(cells fp32 [n, 2], S, A)`` for ``bits``-bit keys of
    ``head_dim``. A rotated, normalized coordinate ``y`` (``|y| <= 1``) is put on the grid
    ``u = y S + A`` and read from cell ``round(u)``, which holds the midpoints' count below the
    cell and the one midpoint inside it (on the grid; +inf where none): the code -- how many
    midpoints are ``<= y`` -- is ``count + (u >= threshold)``. Each cell is widened by 0.05 on
    either side (a ``u`` on the edge of two cells may round to either) and still holds one
    midpoint at most: ``S`` is the smallest power of two from 16 for which this holds, ``A = S
    + 1`` keeps cells from 0 on for ``y >= -1``. One table a device, read-only (None where no
    ``S`` up to 256 separates the midpoints)."""
    return _code_lookup_on(head_dim, bits, _device(device))


@functools.cache
def _code_lookup_on(head_dim: int, bits: int, device: torch.device):
    _, mid = _codebook_on(head_dim, bits, torch.device("cpu"))
    mid = mid.double()
    for scale in (16, 32, 64, 128, 256):
        offset = scale + 1
        grid = mid * scale + offset
        edges = torch.arange(2 * offset + 1, dtype=torch.float64)
        low, high = edges - 0.55, edges + 0.55
        inside = (grid[None, :] > low[:, None]) & (grid[None, :] <= high[:, None])
        if int(inside.sum(1).max()) > 1:
            continue
        count = (grid[None, :] <= low[:, None]).sum(1).to(torch.int32)
        threshold = torch.full((len(edges),), math.inf, dtype=torch.float64)
        cell, which = inside.nonzero(as_tuple=True)
        threshold[cell] = grid[which]
        cells = torch.stack([threshold.float().view(torch.int32), count], 1)
        return cells.view(torch.float32).to(device), float(scale), float(offset)
    return None


@functools.cache
def _hadamard_on(head_dim: int, device: torch.device) -> torch.Tensor:
    return _hadamard_cpu(head_dim).to(device)


@functools.cache
def _codebook_on(head_dim: int, bits: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.tensor(lloyd_max_centroids(head_dim, bits), dtype=torch.float32, device=device)
    return c, (c[:-1] + c[1:]) / 2


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., n]`` (integers below ``2^bits``; ``n * bits`` a multiple of 8) as an
    LSB-first bit stream, ``uint8 [..., n * bits / 8]``."""
    n = codes.shape[-1]
    c = codes.to(torch.int64)
    if bits == 4:
        return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)
    shifts = torch.arange(8, device=codes.device) * bits
    words = (c.unflatten(-1, (n // 8, 8)) << shifts).sum(-1)  # 8 codes a bits-byte word
    out = torch.stack([(words >> (8 * i)) & 0xFF for i in range(bits)], -1)
    return out.flatten(-2).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`pack_bits` undone: ``int64 [..., n]``."""
    p = packed.to(torch.int64)
    if bits == 4:
        return torch.stack([p & 0xF, p >> 4], -1).flatten(-2)[..., :n]
    groups = p.unflatten(-1, (p.shape[-1] // bits, bits))
    words = sum(groups[..., i] << (8 * i) for i in range(bits))
    shifts = torch.arange(8, device=packed.device) * bits
    return ((words[..., None] >> shifts) & (2 ** bits - 1)).flatten(-2)[..., :n]


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x [...]`` as fp16, its two bytes little-endian: ``uint8 [..., 2]``."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _fp16_from(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def quantize_slots(key: torch.Tensor, value: torch.Tensor, preset: TurboQuantPreset
                   ) -> torch.Tensor:
    """``key`` / ``value`` ``[..., head_dim]`` as slots ``uint8 [..., slot_bytes]`` (the format
    above), in fp32 on the inputs' device."""
    d = key.shape[-1]
    k, v = key.float(), value.float()
    parts = []
    if preset.fp8_keys:
        parts.append(k.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        norm = k.norm(dim=-1)
        y = (k / (norm[..., None] + 1e-8)) @ hadamard(d, k.device)
        _, mid = codebook(d, preset.key_bits, k.device)
        idx = torch.searchsorted(mid, y.contiguous(), right=True)
        parts += [pack_bits(idx, preset.key_bits), _fp16_bytes(norm)]
    lo, hi = v.amin(-1), v.amax(-1)
    top = 2 ** preset.value_bits - 1
    scale = ((hi - lo) / top).clamp_min(1e-8)
    codes = torch.floor((v - lo[..., None]) / scale[..., None] + 0.5).clamp(0, top)
    parts += [pack_bits(codes, preset.value_bits), _fp16_bytes(scale), _fp16_bytes(lo)]
    slots = torch.cat(parts, -1)
    pad = preset.slot_bytes(d) - slots.shape[-1]
    return torch.nn.functional.pad(slots, (0, pad)) if pad else slots


def dequantize_slots(slots: torch.Tensor, preset: TurboQuantPreset, head_dim: int,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``uint8 [..., slot_bytes]`` read back as ``(key, value)`` ``[..., head_dim]`` in
    ``dtype`` (fp32 arithmetic; fp64 for the tests' oracle), norm correction included."""
    d = head_dim
    kb = preset.key_bytes(d)
    if preset.fp8_keys:
        k = slots[..., :d].contiguous().view(torch.float8_e4m3fn).to(dtype)
    else:
        packed = kb - 2
        c, _ = codebook(d, preset.key_bits, slots.device)
        cen = c.to(dtype)[unpack_bits(slots[..., :packed], preset.key_bits, d)]
        if preset.norm_correction:
            cen = cen / torch.sqrt((cen * cen).sum(-1, keepdim=True) + 1e-16)
        norm = _fp16_from(slots[..., packed:kb]).to(dtype)
        k = norm[..., None] * (cen @ hadamard(d, slots.device).to(dtype))
    vb = -(-d * preset.value_bits // 8)
    codes = unpack_bits(slots[..., kb:kb + vb], preset.value_bits, d).to(dtype)
    scale = _fp16_from(slots[..., kb + vb:kb + vb + 2]).to(dtype)
    lo = _fp16_from(slots[..., kb + vb + 2:kb + vb + 4]).to(dtype)
    return k, codes * scale[..., None] + lo[..., None]
