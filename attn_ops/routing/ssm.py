"""The recurrent-state family's routing: which kernels an op runs."""

from __future__ import annotations

import torch

from attn_ops.routing.common import Kernel

__all__ = ["lightning_split_chunk", "mamba1_read_ahead", "mamba1_segment",
           "mamba1_walk_read_ahead", "ssm_kernel"]

# sm_90 registers a thread (the most ptxas gives before spilling), a multiprocessor's register
# file (sm_70 on), and the registers of Mamba1's unrolled walk at d_state 16, one channel a
# thread, reading 0-4 tokens ahead (its sm_90 builds; beside each channel's state, rates and
# reads ahead it holds about 26)
_SM90_REGISTERS = 255
_REGISTERS_PER_SM = 65536
_WALK_REGISTERS_D16 = (66, 104, 128, 168, 255)
_WALK_OTHER_REGISTERS = 26
# The walk's time at 0-4 tokens ahead relative to three, at one wave of programs (H100,
# Mamba-2.8B walked whole: 8 x 2k 2.473 / 1.171 / 0.898 / 0.801 ms at 0-3; 4 x 4k 1.388 /
# 1.323 ms at 3 / 4)
_WALK_PACE = (3.09, 1.46, 1.12, 1.0, 0.953)


def ssm_kernel(on_gpu: bool, dtype: torch.dtype, triton_available: bool,
               max_query_len: int = 1, one_slot: bool = True,
               chunked_min_query_len: int | None = None) -> Kernel:
    """The kernels of a recurrent-state op (``backends/ssm``): Triton on GPUs for 16- and
    32-bit inputs (they compute in fp32), else the torch body -- on the CPU, and for fp64, the
    oracle's precision, which fp32 kernels must not round. Ops with a chunked kernel
    (``chunked_min_query_len`` given: ``Tuning.ssm``) run it for steps whose longest request
    has at least that many new tokens, one state slot a request."""
    if not (on_gpu and triton_available and dtype != torch.float64):
        return Kernel.SSM_TORCH
    if chunked_min_query_len is not None and one_slot and max_query_len >= chunked_min_query_len:
        return Kernel.SSM_TRITON_CHUNKED
    return Kernel.SSM_TRITON


def mamba1_segment(requests: int, tokens: int, max_query_len: int, channel_blocks: int,
                   num_sms: int, segment: int, walk_min_programs: int) -> int:
    """The segment length of Mamba1's unrolled prefill for a step (0: one walk a request).

    One walk a request steps each token once; segments step it twice (each segment's state
    from zero, then its outputs from its start state) but run a long request's token loops
    side by side. So a step walks its requests whole where its programs (a request and a
    block of channels) fill the GPU -- ``walk_min_programs`` an SM -- and its longest request
    is at most twice the mean (the walk lasts as long as the longest); otherwise, and always
    where ``walk_min_programs`` is 0, it runs segments of ``segment`` tokens."""
    if not segment:
        return 0
    filled = walk_min_programs and requests * channel_blocks >= walk_min_programs * num_sms
    if filled and max_query_len * requests <= 2 * max(tokens, 1):
        return 0
    return segment


def mamba1_read_ahead(max_query_len: int, prefetch: bool) -> bool:
    """Whether Mamba1's token-by-token kernel reads each token's inputs a step ahead
    (``Tuning.ssm.mamba1_prefetch``): not for a step of one token a request, whose reads ahead
    all fall past its end -- they would only hold registers (sm_90, 64 channels on 4 warps: 77
    a thread with them, 64 without) and the occupancy a state read needs."""
    return prefetch and max_query_len > 1


def mamba1_walk_read_ahead(d_state: int, prefetch: int, programs: int = 0, num_sms: int = 0,
                           channels_a_thread: int = 1, warps: int = 4) -> int:
    """The tokens Mamba1's unrolled walk reads ahead for a ``d_state``
    (``Tuning.ssm.mamba1_unrolled_prefetch``, at most four: the kernel's buffers), as many as
    keep a thread's registers from spilling -- each channel's state and rates take ``2
    d_state`` of them, each token read ahead ``2 d_state`` more (its ``B`` and ``C``): sm_90
    builds, d_state 16 at 0-4 tokens 66 / 104 / 128 / 168 / 255 registers; 32 at 2 247; 64 at
    1 255 and 48 bytes spilled, at 0 168; 128 at 0 255 and 200 bytes spilled (the state
    alone).

    Given the launch's ``programs`` (of ``warps`` warps, ``channels_a_thread``) and the
    device's ``num_sms``: the one of the least waves of resident programs x its pace
    (:data:`_WALK_PACE`; ties: the most). More tokens an iteration spread its exposed read
    latency wider, but their registers fit fewer programs on an SM, and a second wave costs a
    whole walk. H100, Mamba-2.8B (128 channels a program, 40 a request), ms two / three tokens
    ahead: 8 x 2k 0.898 / 0.801 (320 programs: one wave of 4 or 3 an SM), 16 x 2k 1.754 /
    1.582 (two waves either way), 12 x 2k 1.076 / 1.463 (480: one wave of 4 an SM, two of 3),
    32 x 1k 1.427 / 1.519, 64 x 512 1.334 / 1.400; four ahead at 4 x 4k (160: one wave of 2
    an SM) 1.323 against three's 1.388."""
    def registers(ahead: int) -> int:  # (the d_state 16 build's, scaled by the state's size)
        own = (_WALK_REGISTERS_D16[ahead] - _WALK_OTHER_REGISTERS
               + (2 + 2 * ahead) * (d_state - 16))
        return _WALK_OTHER_REGISTERS + channels_a_thread * own

    most = max(0, min(prefetch, len(_WALK_REGISTERS_D16) - 1))
    while most and registers(most) > _SM90_REGISTERS:
        most -= 1
    if not (programs and num_sms):
        return most

    def waves(ahead: int) -> int:
        warp_registers = -(-registers(ahead) // 8) * 8 * 32  # (allocated in 8s a thread)
        resident = max(1, _REGISTERS_PER_SM // warp_registers // warps) * num_sms
        return -(-programs // resident)

    return min(range(most + 1), key=lambda ahead: (waves(ahead) * _WALK_PACE[ahead], -ahead))


# Triton's default software-pipelining depth on NVIDIA GPUs (the split's launches set none)
_TRITON_STAGES = 3


def lightning_split_chunk(chunk: int, dk: int, state_block_v: int, elem_bytes: int,
                          shared_per_block: int | None) -> int:
    """The chunk of lightning attention's split prefill (``Tuning.ssm.lightning_split_chunk``,
    a power of two >= 16) for the hand-off's ``dk`` key rows a program (a power of two),
    halved while its pipelined ``k`` and ``v`` tiles -- ``_TRITON_STAGES`` x chunk x (``dk`` +
    ``state_block_v``) values -- would not fit a block's shared memory (``None``: not a CUDA
    device, nothing to fit). sm_90 builds, bf16, 64 columns: 128 rows at 128 tokens 147,456
    bytes, 256 rows at 128 245,760 -- over the H100's and H200's 232,448 -- and at 64 131,072,
    as counted here (fp32 inputs build smaller than counted: an upper bound)."""
    while (shared_per_block is not None and chunk > 16
           and _TRITON_STAGES * chunk * (dk + state_block_v) * elem_bytes > shared_per_block):
        chunk //= 2
    return chunk
