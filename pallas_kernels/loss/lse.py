"""Per-token cross-entropy whose log-sum-exp reads the logits once (custom VJP; Triton GPU).

``cross_entropy(logits, targets) -> losses`` with ``logits: [..., V]`` (bfloat16 or float32)
and ``targets: [...]`` int: ``logsumexp(logits) - logits[target]`` in float32.

XLA computes a row's log-sum-exp in two passes over the logits, the maximum and then the sum of
exponentials (``jax.nn.logsumexp``; splitting the row into chunks in jnp does not change that,
docs/bench/performance_log.md, session 37). At a 32K vocabulary and 32K tokens a step those are
two reads of 2 GiB of bfloat16 logits. Here one Triton program per ``_ROWS`` rows walks the row
in chunks of up to ``_COLS`` columns, keeping a running maximum ``m`` and the sum ``s`` of
``exp(logit - m)`` (rescaled when ``m`` grows): one read. The target's logit is a gather of one
value a row.

The backward is jnp, one pass that XLA fuses: ``dlogits = g * (softmax - onehot(target))`` in
float32, rounded once to the logits' dtype. (The loss's two parts differentiated apart would
round the softmax and the one-hot to bfloat16 before adding them, which loses the gradient at
a target predicted with probability near 1.)

Under a mesh (``partitioning.shard_local``) each device runs the kernel over its share of the
vocabulary and its rows and returns its ``(m, s)``; the shares are combined in jnp:
``lse = M + log(sum_i s_i exp(m_i - M))``, ``M = max_i m_i``.

Triton lowering (``interpret=True``: Pallas' interpreter, the CPU tests). ``V`` must be a
multiple of 16 (``supported``): a chunk is the largest power of two up to ``_COLS`` that divides
it (``V = 256,000``: 2048). Any number of rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sharding import partitioning

_ROWS = 4        # rows per program
_COLS = 2048     # the most columns a loop step loads
_WARPS = 4
# The smallest vocabulary for which ``auto`` takes the kernel: below it the logits are small
# and XLA's two passes cost little.
MIN_VOCAB = 4096


def chunk(vocab: int) -> int:
  """Columns per loop step: the largest power of two up to ``_COLS`` that divides ``vocab``."""
  c = _COLS
  while c > 1 and vocab % c:
    c //= 2
  return c


def supported(vocab: int) -> bool:
  return chunk(vocab) >= 16


def reference(logits, targets):
  """The same losses in jnp, in float32 (float64 for float64 logits)."""
  x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  picked = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return jax.nn.logsumexp(x, axis=-1) - picked


def _kernel(x_ref, m_ref, s_ref, *, n, vocab, cols):
  f32 = jnp.float32
  start = pl.program_id(0) * _ROWS
  ok = start + jnp.arange(_ROWS) < n
  rows = pl.ds(start, _ROWS)
  mask = jnp.broadcast_to(ok[:, None], (_ROWS, cols))

  def step(c, carry):
    m, s = carry
    tile = plgpu.load(x_ref.at[rows, pl.ds(pl.multiple_of(c * cols, cols), cols)], mask=mask,
                      other=0.0).astype(f32)
    m_new = jnp.maximum(m, jnp.max(tile, axis=1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(tile - m_new[:, None]), axis=1)
    return m_new, s

  init = (jnp.full((_ROWS,), -jnp.inf, f32), jnp.zeros((_ROWS,), f32))
  m, s = jax.lax.fori_loop(0, vocab // cols, step, init)
  plgpu.store(m_ref.at[rows], m, mask=ok)
  plgpu.store(s_ref.at[rows], s, mask=ok)


def partials(x, *, interpret: bool = False):
  """``(m, s)``, float32 ``[N]`` each, for ``x: [N, V]``: each row's maximum and its sum of
  ``exp(x - m)``."""
  n, vocab = x.shape
  cols = chunk(vocab)
  out = jax.ShapeDtypeStruct((n,), jnp.float32)
  return pl.pallas_call(
      functools.partial(_kernel, n=n, vocab=vocab, cols=cols),
      name="pallas_logsumexp",
      out_shape=(out, out),
      grid=(pl.cdiv(n, _ROWS),),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(x)


def _logsumexp(logits, interpret):
  """Float32 ``[...]``: the log-sum-exp over the last axis, per device's share under a mesh."""
  lead = logits.ndim - 1
  axes = ("batch",) + (None,) * (lead - 1) + ("vocab",)

  def local(x):
    m, s = partials(x.reshape(-1, x.shape[-1]), interpret=interpret)
    return m.reshape(*x.shape[:-1], 1), s.reshape(*x.shape[:-1], 1)

  # Each device's (m, s) for its share of the vocabulary, along a last axis of one entry a
  # share (one without a mesh or where the vocabulary is not split).
  m, s = partitioning.shard_local(local, (axes,), (axes, axes))(logits)
  top = jnp.max(m, axis=-1, keepdims=True)
  return top[..., 0] + jnp.log(jnp.sum(s * jnp.exp(m - top), axis=-1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy(logits, targets, interpret):
  return _fwd(logits, targets, interpret)[0]


def _fwd(logits, targets, interpret):
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  lse = _logsumexp(logits, interpret)
  return lse - picked.astype(jnp.float32), (logits, targets, lse)


def _bwd(interpret, residuals, g):
  del interpret
  logits, targets, lse = residuals
  x = logits.astype(jnp.float32)
  is_target = targets[..., None] == jax.lax.broadcasted_iota(targets.dtype, x.shape, x.ndim - 1)
  grad = (jnp.exp(x - lse[..., None]) - is_target) * g[..., None]
  return grad.astype(logits.dtype), None


_cross_entropy.defvjp(_fwd, _bwd)


def cross_entropy(logits: jax.Array, targets: jax.Array, *, interpret: bool = False) -> jax.Array:
  """Float32 ``[...]`` losses for ``logits: [..., V]`` and int ``targets: [...]`` (see the
  module docstring)."""
  if logits.ndim < 2 or targets.shape != logits.shape[:-1]:
    raise ValueError(f"cross_entropy takes logits [..., V] and targets [...]; got "
                     f"{logits.shape} and {targets.shape}")
  if not supported(logits.shape[-1]):
    raise ValueError(f"cross_entropy: a vocabulary of {logits.shape[-1]} is not a multiple of 16")
  return _cross_entropy(logits, targets.astype(jnp.int32), interpret)
