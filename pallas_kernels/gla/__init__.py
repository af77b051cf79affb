"""Gated Linear Attention kernels (docs/kernels.md, "GLA").

Public calls:

- ``chunk_gla(q, k, v, log_g, h0=None, *, scale=None, reset=None, chunk_size=64,
  interpret=False, platform=None) -> (o, h_last)``: the chunkwise-parallel form, differentiable.
- ``gla_recurrent_step(q_t, k_t, v_t, log_g_t, state, *, scale=None) -> (o, state)``: one
  token (decoding).
- ``gla_reference(q, k, v, log_g, h0=None, *, scale=None, reset=None, chunk_size=64)``: the
  pure-JAX chunked reference (also the CPU path of the model).

Modules: ``chunk`` (the entry point and the TPU custom VJP), ``tpu`` and ``chunk_math`` (the
Mosaic kernels and their per-chunk arithmetic), ``gpu`` (Triton kernels), ``gpu_xla`` (XLA
products and the linear-scan kernel, the GPU fallback), ``reference``. Which runs where:
``pallas_kernels.dispatch.gla_path``.
"""

from pallas_kernels.gla.chunk import chunk_gla
from pallas_kernels.gla.reference import gla_recurrent_step, gla_reference

__all__ = ["chunk_gla", "gla_recurrent_step", "gla_reference"]
