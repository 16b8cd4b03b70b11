"""FLEX_ATTENTION's one kernel of its own: the gathered layout's page copy.

``gather_pages_kernel`` copies, per program, one slot of one physical page (``page_map``'s
entry ``pid`` = virtual page ``v``, part ``i``) into gathered slot ``pid * BLOCK_SIZE + s`` of
the packed cache ``[V, f * BLOCK_SIZE, heads, C * DC]``: the source slot's ``C`` halves (K and V
of an interleaved cache, or the whole packed slot, ``C = 1``) side by side. A slot of every head
at once, 16-byte rows each way -- ``torch.index_select`` over the cache's slot-major view does
the same copy element by element (H200, 1x1k, page 16: 9.8 us for 4 MiB).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_pages_kernel(src_ptr, page_map_ptr, dst_ptr, stride_page, stride_slot, stride_head,
                        stride_half, BLOCK_SIZE: tl.constexpr, H: tl.constexpr,
                        H_P: tl.constexpr, C: tl.constexpr, DC: tl.constexpr,
                        DC_P: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    page = tl.load(page_map_ptr + pid).to(tl.int64)
    offs_h = tl.arange(0, H_P)
    offs_d = tl.arange(0, DC_P)
    ok = (offs_h[:, None] < H) & (offs_d[None, :] < DC)
    src = src_ptr + page * stride_page + s * stride_slot + offs_h[:, None] * stride_head \
        + offs_d[None, :]
    dst = dst_ptr + (pid.to(tl.int64) * BLOCK_SIZE + s) * (H * C * DC) \
        + offs_h[:, None] * (C * DC) + offs_d[None, :]
    for c in tl.static_range(C):
        tl.store(dst + c * DC, tl.load(src + c * stride_half, mask=ok), mask=ok)
