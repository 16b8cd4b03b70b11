"""TURBOQUANT: standard attention over vLLM's TurboQuant KV cache (3- and 4-bit keys and values,
or fp8 keys and 4-bit values). ``format``: the slot format byte by byte, quantize and
dequantize in torch; ``ops``: the cache write and attention ops (torch bodies: the CPU path and
the oracle; on GPUs the Triton write of ``write_kernels`` and TRITON_ATTN's kernels reading
the slots with ``read_kernels``); ``backend``: the registry entry."""
