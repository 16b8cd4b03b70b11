"""The recurrent-state family: layers that carry a per-request state instead of a KV cache.

``spec``: the state specs of each layer kind and their state caches; ``metadata``: a step's
state slots, initial-state flags and chunk boundaries; ``conv``: the causal depthwise
convolution every kind starts with (prefill over varlen requests and the decode update);
``gated_deltanet``, ``mamba2``, ``short_conv``: each kind's recurrent op, whose torch body is
the reference (the oracle in fp64, and the CPU path).
"""
