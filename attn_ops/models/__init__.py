"""Example decoders built on :mod:`attn_ops.layers`, used by the demo, the tests and the
benchmarks (with HF transformers' models as their peers):

* :mod:`~attn_ops.models.llama` -- :class:`TinyLlama` and its continuous-batching
  :class:`Generator`;
* :mod:`~attn_ops.models.deepseek` -- :class:`TinyDeepseek` (MLA, YaRN, HF weight loading);
* :mod:`~attn_ops.models.hybrid` -- :class:`HybridModel` (attention beside recurrent layers) and
  its generator and CUDA-graph runner.
"""
