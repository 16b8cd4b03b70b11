"""The MLA family: DeepSeek-style multi-head latent attention over a latent cache.

``common``: the latent cache, its write op, the LSE merge op, the step plan and the executor of
the absorbed and MHA forms; ``reference``: REFERENCE_MLA, the oracle and CPU path;
``unavailable``: the vendor MLA backends that cannot run on this stack, with their causes.
"""
