"""The Gated Linear Attention block (Yang et al. 2023, arXiv 2312.06635, section 4).

Per head, with ``K = expand_k * D / heads`` and ``V = expand_v * D / heads``::

    q, k = x W_q, x W_k        v = x W_v
    log alpha_t = logsigmoid(x_t W_1 W_2 + b) / 16     (low-rank forget gate, rank 16)
    S_t = Diag(alpha_t) S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(K)
    y = W_o (RMSNorm_head(o) * swish(x W_r + b_r))

The recurrence runs in ``pallas_kernels.chunk_gla`` (chunkwise-parallel) on TPU and GPU and in
its pure-JAX chunked reference on CPU (``pallas_kernels.dispatch.gla_path``); a document boundary
(``segment_pos == 0``) zeroes the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels import dispatch
from recurrentgemma_jax import layers
from sharding import partitioning

GATE_TEMPERATURE = 16.0


class GLABlock(nnx.Module):

  def __init__(self, cfg, *, rngs: nnx.Rngs, final_init_scale: float = 1.0,
               param_dtype=jnp.float32, dtype=jnp.float32):
    width = cfg.width
    self.num_heads = cfg.gla_num_heads or cfg.num_heads
    self.key_dim = int(width * cfg.gla_expand_k)
    self.value_dim = int(width * cfg.gla_expand_v)
    self.chunk_size = cfg.gla_chunk_size
    self.impl = cfg.scan_impl
    self.dtype = dtype
    kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
    self.proj_q = layers.Dense(width, self.key_dim, axes=("embed", "heads"), use_bias=False, **kw)
    self.proj_k = layers.Dense(width, self.key_dim, axes=("embed", "heads"), use_bias=False, **kw)
    self.proj_v = layers.Dense(width, self.value_dim, axes=("embed", "heads"), use_bias=False,
                               **kw)
    self.gate_down = layers.Dense(width, cfg.gla_gate_rank, axes=("embed", None),
                                  use_bias=False, **kw)
    self.gate_up = layers.Dense(cfg.gla_gate_rank, self.key_dim, axes=(None, "heads"), **kw)
    self.proj_r = layers.Dense(width, self.value_dim, axes=("embed", "heads"), **kw)
    self.head_norm = layers.RMSNorm(self.value_dim // self.num_heads, param_dtype=param_dtype,
                                    axis_name=None)
    self.proj_out = layers.Dense(self.value_dim, width, axes=("heads", "embed"),
                                 init_scale=final_init_scale, **kw)

  def __call__(
      self,
      x: Float[Array, "b t d"],
      segment_pos: Int[Array, "b t"],
      cache: Float[Array, "b h k v"] | None = None,
  ) -> tuple[Float[Array, "b t d"], Float[Array, "b h k v"]]:
    """Returns the block output and the last state (float32), the decoding cache."""
    b, t, _ = x.shape
    heads = self.num_heads
    split = lambda y: y.reshape(b, t, heads, -1)
    q, k, v = split(self.proj_q(x)), split(self.proj_k(x)), split(self.proj_v(x))
    gate_logits = self.gate_up(self.gate_down(x)).astype(layers.accumulation_dtype(x.dtype))
    log_g = split(jax.nn.log_sigmoid(gate_logits) / GATE_TEMPERATURE)
    o, state = self._recurrence(q, k, v, log_g, cache, segment_pos == 0)
    o = self.head_norm(o).reshape(b, t, self.value_dim)
    return self.proj_out(o * jax.nn.swish(self.proj_r(x))), state

  def init_cache(self, batch_size: int, max_len: int, dtype) -> jax.Array:
    """The empty state ``[B, heads, K, V]`` (float32), whatever ``max_len``."""
    del max_len, dtype
    heads = self.num_heads
    return jnp.zeros((batch_size, heads, self.key_dim // heads, self.value_dim // heads),
                     jnp.float32)

  def _recurrence(self, q, k, v, log_g, h0, reset):
    import pallas_kernels  # pylint: disable=g-import-not-at-top  (optional kernels)
    if q.shape[1] == 1 and h0 is not None:  # decoding: one recurrent step
      h0 = jnp.where(reset[:, 0, None, None, None], 0.0, h0)
      o, state = pallas_kernels.gla_recurrent_step(q[:, 0], k[:, 0], v[:, 0], log_g[:, 0], h0)
      return o[:, None], state
    use_kernel = self.impl == "pallas" or (
        self.impl == "auto" and dispatch.target_platform() in ("tpu", "gpu"))
    if use_kernel:
      # Per device under a mesh: rows over ``data``, heads over ``model``.
      bthk, bhkv = ("batch", None, "heads", None), ("batch", "heads", None, None)
      kernel = lambda q, k, v, g, h, r: pallas_kernels.chunk_gla(
          q, k, v, g, h, reset=r, chunk_size=self.chunk_size)
      return partitioning.shard_local(
          kernel, (bthk, bthk, bthk, bthk, bhkv, ("batch", None)), (bthk, bhkv))(
              q, k, v, log_g, h0, reset)
    chunk = min(self.chunk_size, max(16, q.shape[1]))
    return pallas_kernels.gla_reference(q, k, v, log_g, h0, reset=reset, chunk_size=chunk)
