"""Small layers shared by every block: parameters with logical axes, RMSNorm, dense and
block-diagonal projections, the temporal Conv1D and the embedder.

Every parameter carries an ``axes`` metadata tuple of logical axis names (``embed``, ``mlp``,
``lru``, ``heads``, ``kv``, ``vocab``, ``blocks`` or None); ``sharding/`` maps those names to mesh
axes, so no layer knows about devices. Parameter names follow the official RecurrentGemma tree so
that importing a checkpoint is a rename of paths, not of meanings.

Shapes: ``B`` batch, ``T`` time, ``D`` input width, ``F`` output width.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels.conv1d import causal as conv_kernels
from pallas_kernels.norm import rms as norm_kernels
from pallas_kernels import dispatch
from sharding import partitioning

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def fan_in_normal(scale: float = 1.0, in_axis: int | Sequence[int] = -2) -> Initializer:
  """Normal with variance ``scale / fan_in`` (not truncated, as in the official models)."""
  return nnx.initializers.variance_scaling(scale, "fan_in", "normal", in_axis=in_axis)


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    dtype: jnp.dtype,
    axes: tuple[str | None, ...],
) -> nnx.Param:
  """A parameter initialised in float32 (then cast) and tagged with logical axis names."""
  assert len(axes) == len(shape), (shape, axes)
  value = init(rngs.params(), tuple(shape), jnp.float32).astype(dtype)
  return nnx.Param(value, axes=axes)


def accumulation_dtype(dtype) -> jnp.dtype:
  """Float32, or float64 for float64 inputs (the gradient checks run in float64)."""
  return jnp.promote_types(dtype, jnp.float32)


def zeros(shape: Sequence[int], dtype: jnp.dtype, axes: tuple[str | None, ...]) -> nnx.Param:
  assert len(axes) == len(shape), (shape, axes)
  return nnx.Param(jnp.zeros(tuple(shape), dtype), axes=axes)


class RMSNorm(nnx.Module):
  """``x / rms(x) * (1 + scale)``, computed in float32 whatever the activation dtype."""

  def __init__(self, width: int, *, param_dtype=jnp.float32, axis_name: str = "embed",
               eps: float = 1e-6, impl: str = "xla"):
    self.eps = eps
    self.axis_name = axis_name
    # xla | pallas: ``with_skip``'s backward as pallas_kernels.norm's Triton kernel
    # (interpreted on a CPU; a TPU takes XLA's).
    self.impl = impl
    self.scale = zeros((width,), param_dtype, (axis_name,))

  def __call__(self, x: Float[Array, "*b d"]) -> Float[Array, "*b d"]:
    return norm_kernels.forward(x, self.scale.value, self.eps)

  def with_skip(self, x: Float[Array, "*b d"]) -> tuple[Float[Array, "*b d"], Float[Array, "*b d"]]:
    """``(x, self(x))`` for a pre-norm residual block, which keeps ``x`` for its skip
    connection. With ``impl="pallas"`` the backward is one kernel pass that also adds the
    skip's gradient (``pallas_kernels.norm``); the values are the same either way."""
    interpret = dispatch.triton_interpret()
    if self.impl != "pallas" or interpret is None or not norm_kernels.supported(x.shape[-1]):
      return x, self(x)
    # Per device under a mesh: rows over ``data``; the normalised axis is not split (``embed``).
    rows = ("batch",) + (None,) * (x.ndim - 2) + (self.axis_name,)
    norm = functools.partial(norm_kernels.rms_norm_with_skip, eps=self.eps, interpret=interpret)
    return partitioning.shard_local(norm, (rows, (self.axis_name,)), (rows, rows))(
        x, self.scale.value)


class Dense(nnx.Module):
  """``x @ kernel (+ bias)`` with kernel ``[D, F]``, computed in ``dtype``."""

  def __init__(self, in_features: int, out_features: int, *, axes: tuple[str | None, str | None],
               rngs: nnx.Rngs, use_bias: bool = True, init_scale: float = 1.0,
               param_dtype=jnp.float32, dtype=jnp.float32):
    self.dtype = dtype
    self.kernel = param(rngs, fan_in_normal(init_scale), (in_features, out_features),
                        param_dtype, axes)
    self.bias = zeros((out_features,), param_dtype, (axes[1],)) if use_bias else None

  def __call__(self, x: Float[Array, "*b d"]) -> Float[Array, "*b f"]:
    y = jnp.dot(x.astype(self.dtype), self.kernel.value.astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias.value.astype(self.dtype)
    return y


class BlockDiagonalLinear(nnx.Module):
  """A linear map made of ``num_blocks`` independent ``[D/n, F/n]`` blocks.

  The Griffin paper uses it for the RG-LRU gates so that they shard over channels with no
  communication: block ``h`` reads and writes only channels ``h*D/n .. (h+1)*D/n``. This is
  XLA's form; ``recurrent.RGLRU`` takes both of its gates through one Pallas kernel instead
  where ``gate_impl`` asks for it.
  """

  def __init__(self, width_in: int, width_out: int, num_blocks: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, dtype=jnp.float32):
    self.num_blocks = num_blocks
    self.dtype = dtype
    self.w = param(rngs, fan_in_normal(1.0),
                   (num_blocks, width_in // num_blocks, width_out // num_blocks), param_dtype,
                   ("blocks", None, None))
    self.b = zeros((num_blocks, width_out // num_blocks), param_dtype, ("blocks", None))

  def __call__(self, x: Float[Array, "*b t d"]) -> Float[Array, "*b t f"]:
    return block_diagonal(x, self.w.value, self.b.value, self.dtype)


def block_diagonal(x, w, b, dtype):
  """``BlockDiagonalLinear``'s map of ``x`` ``[..., H*I]`` by ``w`` ``[H, I, J]`` and ``b``
  ``[H, J]``, in ``dtype``."""
  x = x.astype(dtype)
  y = jnp.einsum("...hi,hij->...hj", x.reshape(*x.shape[:-1], w.shape[0], -1), w.astype(dtype))
  return y.reshape(*x.shape[:-1], -1) + b.astype(dtype).reshape(-1)


def document_ids(segment_pos: Int[Array, "b t"]) -> Int[Array, "b t"]:
  """Numbers the documents of each row (a new one starts wherever ``segment_pos == 0``)."""
  return jnp.cumsum(segment_pos == 0, axis=-1)


class Conv1D(nnx.Module):
  """Causal channel-wise convolution over time, ``temporal_width`` taps, reset at documents.

  ``y[t] = b + sum_s w[W-1-s] * x[t-s]`` over the taps ``s`` whose input lies in the same
  document as ``t``. In decoding, ``state`` is a ring buffer of the last ``W-1`` inputs, slot
  first (``[W-1, B, D]``): the input a cache took as its ``c``-th token (``count``, the same
  for every row) sits in slot ``c % (W-1)``, so a decoding step reads whole slots and writes
  one in place (a dynamic-update-slice) instead of shifting the state; a tap is used only when
  its position is in the token's document (``segment_pos - s >= 0``).
  """

  def __init__(self, width: int, temporal_width: int = 4, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, dtype=jnp.float32, impl: str = "xla"):
    self.temporal_width = temporal_width
    self.dtype = dtype
    # xla | pallas: over whole rows (training, prefill from an empty cache), the backward as
    # pallas_kernels.conv1d's Triton kernel (interpreted on a CPU; a TPU takes XLA's).
    self.impl = impl
    self.w = param(rngs, fan_in_normal(0.01), (temporal_width, width), param_dtype,
                   (None, "lru"))
    self.b = zeros((width,), param_dtype, ("lru",))

  def __call__(
      self,
      x: Float[Array, "b t d"],
      segment_pos: Int[Array, "b t"],
      state: Float[Array, "w b d"] | None = None,
      count: Int[Array, ""] | int = 0,
  ) -> tuple[Float[Array, "b t d"], Float[Array, "w b d"]]:
    """Returns the convolution and the ring buffer after these inputs (``count``: the tokens
    ``state`` has taken)."""
    width = self.temporal_width
    slots = width - 1
    x = x.astype(self.dtype)
    w = self.w.value.astype(self.dtype)
    t = x.shape[1]
    bias = self.b.value.astype(self.dtype)
    if state is not None and t == 1:  # one decoding step: whole slots, one written in place
      out = x * w[slots] + bias
      for shift in range(1, width):
        tap = jax.lax.dynamic_index_in_dim(state, (count - shift) % slots, keepdims=False)
        valid = (segment_pos - shift >= 0)[..., None]  # [b, 1, 1]: in this token's document
        out = out + jnp.where(valid, tap[:, None].astype(x.dtype), 0) * w[slots - shift]
      return out, jax.lax.dynamic_update_index_in_dim(state, x[:, 0].astype(state.dtype),
                                                      count % slots, axis=0)
    doc = document_ids(segment_pos)
    if state is None:
      # Tokens before the row belong to no document: taps reaching them are masked.
      padded, padded_doc = conv_kernels.with_empty_history(x, doc, width)
    else:
      # The cached inputs in time order (slots count, count + 1, ... mod W-1), at positions
      # p0 - W + 1 .. p0 - 1 before the first new token's p0: those before its document
      # (negative positions) are masked, all of them when p0 starts a new document.
      history = jnp.take(state.astype(x.dtype), (count + jnp.arange(slots)) % slots, axis=0)
      padded = jnp.concatenate([history.swapaxes(0, 1), x], axis=1)
      before = segment_pos[:, :1] - slots + jnp.arange(slots)
      padded_doc = jnp.concatenate([jnp.where(before >= 0, 0, -1), doc], axis=1)
    interpret = dispatch.triton_interpret()
    if (state is None and self.impl == "pallas" and interpret is not None
        and conv_kernels.supported(x.shape[-1])):
      # Per device under a mesh (rows over ``data``, channels over ``model``).
      rows = ("batch", None, "lru")
      conv = functools.partial(conv_kernels.causal_conv1d, interpret=interpret)
      out = partitioning.shard_local(conv, (rows, (None, "lru"), ("lru",), ("batch", None)),
                                     rows)(x, self.w.value, self.b.value, doc)
    else:
      out = conv_kernels.forward(padded, padded_doc, w, bias)
    # The last W-1 inputs, taken as tokens count + t - W + 1 .. count + t - 1: slot j holds
    # the one whose number is j mod W-1. (Those of an earlier document are kept: never read.)
    ring = jnp.take(padded[:, -slots:], (jnp.arange(slots) - count - t) % slots, axis=1)
    ring = ring.swapaxes(0, 1)
    return out, ring if state is None else ring.astype(state.dtype)


class Embedder(nnx.Module):
  """Token embedding, shared with the output layer (tied weights)."""

  def __init__(self, vocab_size: int, width: int, *, scale_by_sqrt_dim: bool, rngs: nnx.Rngs,
               param_dtype=jnp.float32, dtype=jnp.float32):
    self.width = width
    self.scale_by_sqrt_dim = scale_by_sqrt_dim
    self.dtype = dtype
    self.input_embedding = param(rngs, fan_in_normal(1.0, in_axis=1), (vocab_size, width),
                                 param_dtype, ("vocab", "embed"))

  def encode(self, tokens: Int[Array, "b t"]) -> Float[Array, "b t d"]:
    # The table as it is used (gathered over ``data`` under ZeRO-3): looked up from a table
    # split over ``data`` by width, XLA gathered the looked-up [B, T, D] rows instead.
    table = partitioning.as_used(self.input_embedding.value, ("vocab", "embed"))
    x = jnp.take(table, tokens, axis=0).astype(self.dtype)
    if self.scale_by_sqrt_dim:
      # RecurrentGemma was trained with the factor rounded to bfloat16; keep that rounding so
      # official checkpoints give the official outputs.
      x = x * jnp.asarray(math.sqrt(self.width), jnp.bfloat16).astype(self.dtype)
    return x

  def decode(self, x: Float[Array, "b t d"]) -> Float[Array, "b t v"]:
    return jnp.dot(x.astype(self.dtype), self.input_embedding.value.astype(self.dtype).T)
