"""FLEX_ATTENTION's one kernel of its own: the gathered layout's page copy.

``gather_pages_kernel`` copies, per program, one slot of one physical page (``page_map``'s
entry ``pid`` = virtual page ``v``, part ``i``) into slot ``pid * BLOCK_SIZE + s`` of the
head-major gathered cache ``[C, heads, total slots, DC]``: the source slot's ``C`` parts (K and
V of an interleaved cache, or the whole packed slot, ``C = 1``) each into its own dense
``[heads, slots, DC]``. A page id outside the cache's ``num_pages`` (``page_map`` arrives on
the device: never trusted) is copied as zeros, never read. A slot of every head at once, rows
of ``DC`` contiguous elements each way (``torch.index_select`` over the cache's slot-major view
copies element by element, about 4x slower).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pages"])
def gather_pages_kernel(src_ptr, page_map_ptr, dst_ptr, num_pages, stride_page, stride_slot,
                        stride_head, stride_part, total_slots, BLOCK_SIZE: tl.constexpr,
                        H: tl.constexpr, H_P: tl.constexpr, C: tl.constexpr, DC: tl.constexpr,
                        DC_P: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    page = tl.load(page_map_ptr + pid).to(tl.int64)
    offs_h = tl.arange(0, H_P)
    offs_d = tl.arange(0, DC_P)
    ok = (offs_h[:, None] < H) & (offs_d[None, :] < DC)
    inside = tl.where((page >= 0) & (page < num_pages), ok, False)
    src = src_ptr + page * stride_page + s * stride_slot + offs_h[:, None] * stride_head \
        + offs_d[None, :]
    head_stride = total_slots.to(tl.int64) * DC
    dst = dst_ptr + (pid.to(tl.int64) * BLOCK_SIZE + s) * DC + offs_h[:, None] * head_stride \
        + offs_d[None, :]
    for c in tl.static_range(C):
        tl.store(dst + c * H * head_stride,
                 tl.load(src + c * stride_part, mask=inside, other=0.0), mask=ok)
