"""Attention kernels (docs/design.md, "Attention memory").

Public calls:

- ``splash_mqa(q, k, v, segment_pos, *, window, scale, block=None, interpret=False) -> o``:
  causal multi-query attention within each row of ``q [B, T, N, H]`` against one key/value
  head ``k, v [B, T, H]``, over a local window or globally, packed documents kept apart,
  through JAX's TPU splash attention kernel (its interpreter on a CPU); differentiable.
- ``problem(dtype, platform) -> str | None``: why it cannot run there (the model config's
  check and ``attention_impl=auto`` use it).
- ``decode.mqa_decode(q, keys, values, lengths, *, scale, block_k=64, stages=2,
  interpret=False) -> o``: one query token per row, ``q [B, N, H]``, against each row's first
  ``lengths[b]`` cached keys of one key/value head ``[B, S, H]``, on Hopper's tensor cores
  (Mosaic GPU); ``decode.problem`` says which shapes and dtypes it takes.

Modules: ``splash`` (the wrapper and its limits: rows padded to multiples of 128, any head
size); ``decode`` (MQA's decode attention, what ``dispatch.decode_attention_path`` picks on
Hopper GPUs).
"""

from pallas_kernels.attention.splash import block_size, padded_length, problem, splash_mqa

__all__ = ["block_size", "padded_length", "problem", "splash_mqa"]
