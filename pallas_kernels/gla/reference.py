"""Pure-JAX Gated Linear Attention: a chunked reference and the one-token decoding step.

The recurrence (per batch row and head) is

    S_t = Diag(exp(log_g_t)) S_{t-1} + k_t^T v_t,      o_t = scale * q_t S_t,

with S_t a [K, V] matrix. `gla_reference` computes it chunk by chunk with `lax.scan`, the
intra-chunk part in log space over the whole chunk (no secondary chunking: simple, stable and
differentiable by plain autodiff, but it builds a [C, C, K] tensor per chunk, so it is for
checking the Pallas kernel, not for training). `gla_recurrent_step` is the decoding form.
"""

import jax
import jax.numpy as jnp
from jax import lax


def default_scale(head_dim: int) -> float:
  return head_dim**-0.5


def chunk_reset_counts(reset: jax.Array, chunk: int) -> jax.Array:
  """Number of document starts at or before each position, counted within its chunk.

  Args:
    reset: [B, T] bool, True at the first token of a document; T a multiple of `chunk`.
  Returns:
    [B, T] float32. Two positions of one chunk belong to the same document exactly when their
    counts are equal, and a position still sees the state from before its chunk exactly when
    its count is 0. Both the kernel and the reference express resets as these masks, so that
    no gate has to be set to -inf (which would poison the cumulative log-gates with inf - inf).
  """
  b, t = reset.shape
  r = reset.astype(jnp.float32).reshape(b, t // chunk, chunk)
  return jnp.cumsum(r, axis=-1).reshape(b, t)


def add_later_chunks(within: jax.Array, axis: int) -> jax.Array:
  """Reverse cumulative sums over a whole row from reverse cumulative sums within each chunk.

  ``within`` has chunks on ``axis`` and the positions of a chunk on ``axis + 1``; position 0
  of a chunk holds that chunk's whole sum. Adds the sums of all later chunks to every position
  (the backward's d log_g in the TPU path and gla.gpu_xla; gla.gpu's kernels add the later
  chunks' part themselves)."""
  totals = jnp.take(within, 0, axis=axis + 1)
  later = jnp.flip(jnp.cumsum(jnp.flip(totals, axis), axis), axis) - totals
  return within + jnp.expand_dims(later, axis + 1)


def gla_reference(q, k, v, log_g, h0=None, *, scale=None, reset=None, chunk_size=64):
  """Chunked GLA in float32 (float64 for float64 inputs) with `lax.scan` over chunks.

  Args:
    q, k, log_g: [B, T, H, K]; log_g <= 0.
    v: [B, T, H, V].
    h0: [B, H, K, V] initial state, zeros when None.
    scale: multiplies q; K**-0.5 when None.
    reset: [B, T] bool, True where a document starts (the state is zeroed before that token).
    chunk_size: chunk length C.
  Returns:
    o: [B, T, H, V] in q's dtype; h_last: [B, H, K, V] float32.
  """
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  scale = default_scale(dk) if scale is None else scale
  c = chunk_size
  tp = -(-t // c) * c
  acc = jnp.promote_types(q.dtype, jnp.float32)
  pad = lambda x: jnp.pad(x.astype(acc), ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  # [NT, B, H, C, X]: scan over chunks.
  chunked = lambda x: pad(x).reshape(bsz, tp // c, c, h, -1).transpose(1, 0, 3, 2, 4)
  qc, kc, vc, gc = chunked(q * scale), chunked(k), chunked(v), chunked(log_g)
  if reset is None:
    rc = jnp.zeros((tp // c, bsz, 1, c), acc)
  else:
    r = jnp.pad(reset, ((0, 0), (0, tp - t)))
    rc = chunk_reset_counts(r, c).reshape(bsz, tp // c, 1, c).transpose(1, 0, 2, 3)
  s0 = jnp.zeros((bsz, h, dk, dv), acc) if h0 is None else h0.astype(acc)
  causal = jnp.tril(jnp.ones((c, c), bool))

  def step(s, xs):
    qi, ki, vi, gi, ri = xs
    b = jnp.cumsum(gi, axis=2)  # [B, H, C, K], decreasing along C
    total = b[:, :, -1:, :]
    seen = (ri == 0)[..., None]  # [B, 1, C, 1]: no document start yet in this chunk
    same_doc = ri[..., :, None] == ri[..., None, :]  # [B, 1, C, C]
    mask = causal & same_doc
    # Every exponent is a later minus an earlier cumulative log-gate, hence <= 0.
    decay = jnp.exp(jnp.minimum(b[:, :, :, None, :] - b[:, :, None, :, :], 0.0))
    scores = jnp.einsum("bhtk,bhuk,bhtuk->bhtu", qi, ki, decay)
    scores = jnp.where(mask, scores, 0.0)
    o = jnp.einsum("bhtk,bhkv->bhtv", qi * jnp.exp(b) * seen, s)
    o = o + jnp.einsum("bhtu,bhuv->bhtv", scores, vi)
    last = ri[..., -1:]  # [B, 1, 1]
    in_last_doc = (ri == last)[..., None]
    kept = jnp.where(last[..., None] == 0, jnp.exp(total), 0.0).swapaxes(-1, -2)  # [B, H, K, 1]
    k_end = ki * jnp.exp(total - b) * in_last_doc
    s = kept * s + jnp.einsum("bhuk,bhuv->bhkv", k_end, vi)
    return s, o

  s_last, o = lax.scan(step, s0, (qc, kc, vc, gc, rc))
  o = o.transpose(1, 0, 3, 2, 4).reshape(bsz, tp, h, dv)[:, :t]
  return o.astype(q.dtype), s_last


def gla_recurrent_step(q_t, k_t, v_t, log_g_t, state, *, scale=None):
  """One decoding step.

  Args:
    q_t, k_t, log_g_t: [B, H, K].
    v_t: [B, H, V].
    state: [B, H, K, V] float32, the state after the previous token.
  Returns:
    o_t: [B, H, V] in q_t's dtype; new_state: [B, H, K, V] float32.
  """
  scale = default_scale(q_t.shape[-1]) if scale is None else scale
  f32 = lambda x: x.astype(jnp.float32)
  new_state = jnp.exp(f32(log_g_t))[..., None] * state + f32(k_t)[..., None] * f32(v_t)[..., None, :]
  o_t = scale * jnp.einsum("bhk,bhkv->bhv", f32(q_t), new_state)
  return o_t.astype(q_t.dtype), new_state
