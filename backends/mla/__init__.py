"""The MLA family: DeepSeek-style multi-head latent attention over a latent cache.

``common``: the latent cache, its write op, the LSE merge op, the step plan and the executor of
the absorbed and MHA forms; ``rope``: RoPE of the rope parts and its fused form with the latent
write; ``prefill``: the MHA form's kernels; ``reference``: REFERENCE_MLA, the oracle and CPU
path; ``triton_mla`` / ``triton_mla_kernels``: TRITON_MLA and its absorbed kernel;
``unavailable``: the vendor MLA backends that cannot run on this stack, with their causes.
"""
