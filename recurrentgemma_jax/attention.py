"""Multi-query attention (one shared key/value head) with RoPE, global or over a local window.

Local attention lets token ``t`` see tokens ``t - window .. t`` of its own document (the
official RecurrentGemma convention: ``window + 1`` keys including itself); global attention
sees every earlier token of its document. RoPE rotates the first half of each head with the
position inside the document, so packed documents get the positions they would have alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from recurrentgemma_jax import layers

_MASKED = -2.3819763e38  # finite, so rows that see nothing give no NaN
_MAX_WAVELENGTH = 10_000


def apply_rope(x: Float[Array, "b t n h"], positions: Int[Array, "b t"]) -> Float[Array, "b t n h"]:
  """Rotates the first half of the head dimension by ``position * frequency``."""
  x_rope, x_pass = jnp.split(x, 2, axis=-1)
  half = x_rope.shape[-1] // 2
  inv_frequencies = 1.0 / _MAX_WAVELENGTH ** (2 * jnp.arange(half) / x_rope.shape[-1])
  angles = positions[:, :, None, None] * inv_frequencies
  sin, cos = jnp.sin(angles).astype(x.dtype), jnp.cos(angles).astype(x.dtype)
  first, second = jnp.split(x_rope, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin, x_pass],
                         axis=-1)


def attention_mask(segment_pos: Int[Array, "b t"], window: int | None) -> Bool[Array, "b t t"]:
  """``mask[b, q, k]``: causal, same document, and within ``window`` when it is set."""
  doc = layers.document_ids(segment_pos)
  pos = jnp.arange(segment_pos.shape[1])
  mask = (pos[:, None] >= pos[None, :])[None] & (doc[:, :, None] == doc[:, None, :])
  if window is not None:
    mask = mask & (pos[:, None] <= pos[None, :] + window)[None]
  return mask


class MQAttention(nnx.Module):
  """``num_heads`` query heads of ``width // num_heads`` dims, one key/value head."""

  def __init__(self, width: int, num_heads: int, window: int | None, *, rngs: nnx.Rngs,
               final_init_scale: float = 1.0, param_dtype=jnp.float32, dtype=jnp.float32):
    self.num_heads = num_heads
    self.head_dim = width // num_heads
    self.window = window
    self.dtype = dtype
    kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype, use_bias=False)
    self.proj_q = layers.Dense(width, width, axes=("embed", "heads"), **kw)
    self.proj_k = layers.Dense(width, self.head_dim, axes=("embed", "kv"), **kw)
    self.proj_v = layers.Dense(width, self.head_dim, axes=("embed", "kv"), **kw)
    kw["use_bias"] = True
    self.proj_final = layers.Dense(width, width, axes=("heads", "embed"),
                                   init_scale=final_init_scale, **kw)

  def __call__(
      self,
      x: Float[Array, "b t d"],
      segment_pos: Int[Array, "b t"],
      cache: None = None,
  ) -> tuple[Float[Array, "b t d"], None]:
    if cache is not None:
      raise NotImplementedError("attention decoding caches are not implemented yet")
    b, t, _ = x.shape
    q = self.proj_q(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.proj_k(x).reshape(b, t, 1, self.head_dim)
    v = self.proj_v(x).reshape(b, t, 1, self.head_dim)
    q = apply_rope(q, segment_pos)
    k = apply_rope(k, segment_pos)
    logits = jnp.einsum("btnh,bsh->bnts", q, k[:, :, 0]) * self.head_dim**-0.5
    mask = attention_mask(segment_pos, self.window)
    logits = jnp.where(mask[:, None], logits, _MASKED).astype(
        layers.accumulation_dtype(x.dtype))
    probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    encoded = jnp.einsum("bnts,bsh->btnh", probs, v[:, :, 0])
    return self.proj_final(encoded.reshape(b, t, -1)), None
