"""The RG-LRU (Griffin paper, section 2.4) and the recurrent temporal-mixing block.

RG-LRU, per channel, with ``c = 8`` and ``a = sigmoid(-a_param)`` (official parameter name;
the paper's ``Lambda`` is ``-a_param``)::

    r_t = sigmoid(W_a x_t + b_a)           recurrence gate (block-diagonal W_a)
    i_t = sigmoid(W_x x_t + b_x)           input gate      (block-diagonal W_x)
    log a_t = -c * r_t * softplus(a_param) = c * r_t * log(a)    (log space: no underflow)
    h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)

At the first token of a document the state is dropped (``a_t = 0``) and the input is not
normalised, so packed rows behave as separate sequences.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels import dispatch
from pallas_kernels import gates
from pallas_kernels.rg_lru import decode as decode_kernel
from recurrentgemma_jax import layers
from recurrentgemma_jax import scan as scan_lib
from sharding import partitioning

# The derivative of sqrt(1 - a^2) blows up as a -> 1; it is clipped at this value (as in the
# official implementation) so that bfloat16 training never sees inf.
MAX_SQRT_GRADIENT = 1000.0
C = 8.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def sqrt_bounded_derivative(x: jax.Array, max_gradient: float) -> jax.Array:
  """``sqrt(x)`` whose derivative is at most ``max_gradient``."""
  del max_gradient
  return jnp.sqrt(x)


def _sqrt_fwd(x, max_gradient):
  del max_gradient
  return jnp.sqrt(x), x


def _sqrt_bwd(max_gradient, x, g):
  x_floor = jnp.maximum(x, 1.0 / (4.0 * max_gradient**2))
  return (g * 0.5 * jax.lax.rsqrt(x_floor),)


sqrt_bounded_derivative.defvjp(_sqrt_fwd, _sqrt_bwd)


def a_param_init(min_ac: float = 0.9, max_ac: float = 0.999) -> layers.Initializer:
  """Initialises ``a_param`` so that ``a^c`` is uniform in ``[min_ac, max_ac]`` (the paper).

  (The official code draws ``a`` itself, not ``a^c``, from a ring; the paper's choice starts
  with longer memory. Initialisation does not affect checkpoint compatibility.)
  """

  def init(key, shape, dtype=jnp.float32):
    ac = jax.random.uniform(key, shape, jnp.float32, min_ac, max_ac)
    softplus_value = -jnp.log(ac) / C  # softplus(a_param) = -log(a)
    return jnp.log(jnp.expm1(softplus_value)).astype(dtype)  # softplus^-1

  return init


@jax.checkpoint
def gated_inputs(x, gate_x_logits, gate_a_logits, a_param, reset):
  """The RG-LRU's per-token gating: the scan's input ``sqrt(1 - a_t^2) * i_t * x_t`` (in x's
  dtype) and its decay ``a_t`` (float32), both restarted at document starts (``reset``).

  The arithmetic runs in float32 (a near 1 is not representable in bfloat16); in float32 this
  is exactly the official computation. ``jax.checkpoint``: the backward pass recomputes it from
  these inputs instead of keeping its float32 intermediates (gates, decay, normalisation) in
  memory, which saves their HBM traffic.
  """
  acc = layers.accumulation_dtype(x.dtype)
  gate_x = jax.nn.sigmoid(gate_x_logits.astype(acc))
  gate_a = jax.nn.sigmoid(gate_a_logits.astype(acc))
  log_a = -C * gate_a * jax.nn.softplus(a_param.astype(acc))
  a = jnp.exp(log_a)
  multiplier = sqrt_bounded_derivative(1.0 - jnp.exp(2.0 * log_a), MAX_SQRT_GRADIENT)
  multiplier = jnp.where(reset[..., None], 1.0, multiplier)
  normalized_x = (x.astype(acc) * gate_x * multiplier).astype(x.dtype)
  return normalized_x, jnp.where(reset[..., None], 0.0, a)


def one_token_update(x, gate_x_logits, gate_a_logits, a_param, reset, h0):
  """The RG-LRU for one token (``x`` and the logits ``[B, 1, D]``, ``reset`` ``[B, 1]``):
  ``(y [B, 1, D], h [B, D])``, ``h = a * h0 + sqrt(1 - a^2) * i * x``."""
  normalized_x, a = gated_inputs(x, gate_x_logits, gate_a_logits, a_param, reset)
  h = a[:, 0] * h0.astype(a.dtype) + normalized_x[:, 0].astype(a.dtype)
  return h[:, None].astype(x.dtype), h


class RGLRU(nnx.Module):
  """Real-Gated Linear Recurrent Unit over ``width`` channels."""

  def __init__(self, width: int, num_blocks: int, *, rngs: nnx.Rngs, scan_impl: str = "auto",
               fused: bool = False, gate_impl: str = "xla",
               a_init: tuple[float, float] = (0.9, 0.999), param_dtype=jnp.float32,
               dtype=jnp.float32):
    """``a_init``: the range ``a^c`` is drawn from, uniformly (``a_param_init``)."""
    self.scan_impl = scan_impl
    self.fused = fused
    # xla | pallas (pallas_kernels.gates: Triton, interpreted on a CPU; a TPU takes XLA's).
    self.gate_impl = gate_impl
    self.dtype = dtype
    self.a_param = layers.param(rngs, a_param_init(*a_init), (width,), param_dtype, ("lru",))
    kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
    self.input_gate = layers.BlockDiagonalLinear(width, width, num_blocks, **kw)
    self.a_gate = layers.BlockDiagonalLinear(width, width, num_blocks, **kw)

  def _gate_kernel(self) -> bool:
    """Whether the gates run through ``pallas_kernels.gates``."""
    return (self.gate_impl == "pallas" and dispatch.triton_interpret() is not None
            and gates.supported(*self.input_gate.w.value.shape[1:]))

  def local_gates(self, x, w_x, w_a, b_x, b_a):
    """``gates`` on one device's shard of ``x`` and of the weights (no mesh handling)."""
    if self._gate_kernel():
      x, (gate_x, gate_a) = gates.block_diagonal_with_skip(
          x, (w_x, w_a), (b_x, b_a), interpret=dispatch.triton_interpret())
      return x, gate_x, gate_a
    return (x, layers.block_diagonal(x, w_x, b_x, self.dtype),
            layers.block_diagonal(x, w_a, b_a, self.dtype))

  def gates(self, x: Float[Array, "b t d"]):
    """``(x, input-gate logits, a-gate logits)``. With the kernel, both gates come from one
    read of ``x`` and ``x`` is passed through the same call, so the backward sums the three
    gradients of ``x`` in the kernel that writes it (``pallas_kernels.gates``)."""
    params = (self.input_gate.w.value, self.a_gate.w.value, self.input_gate.b.value,
              self.a_gate.b.value)
    if not self._gate_kernel():  # XLA partitions its einsum itself
      return self.local_gates(x, *params)
    # Per device under a mesh: a device's channels are whole blocks (``blocks``).
    rows = ("batch",) + (None,) * (x.ndim - 2) + ("blocks",)
    weight, bias = ("blocks", None, None), ("blocks", None)
    return partitioning.shard_local(
        self.local_gates, (rows, weight, weight, bias, bias), (rows, rows, rows))(x, *params)

  def __call__(
      self,
      x: Float[Array, "b t d"],
      segment_pos: Int[Array, "b t"],
      h0: Float[Array, "b d"] | None = None,
  ) -> tuple[Float[Array, "b t d"], Float[Array, "b d"]]:
    """Returns ``y`` (in the activation dtype) and the last state (float32)."""
    x = x.astype(self.dtype)
    reset = segment_pos == 0
    x, gate_x_logits, gate_a_logits = self.gates(x)
    if h0 is not None and x.shape[1] == 1:
      # One decoding step: elementwise, fused by XLA with the gates and written over the
      # cached state in place (the scan kernel costs a launch and a copy of the state).
      return one_token_update(x, gate_x_logits, gate_a_logits, self.a_param.value, reset, h0)
    if self.fused:
      import pallas_kernels  # pylint: disable=g-import-not-at-top  (optional kernels)
      rows, state = scan_lib.ROW_AXES, scan_lib.STATE_AXES
      return partitioning.shard_local(
          pallas_kernels.rg_lru, (rows, rows, rows, ("lru",), ("batch", None), state),
          (rows, state))(x, gate_x_logits, gate_a_logits, self.a_param.value, reset, h0)
    normalized_x, a = gated_inputs(x, gate_x_logits, gate_a_logits, self.a_param.value, reset)
    return scan_lib.linear_scan(normalized_x, a, h0, impl=self.scan_impl)


class RecurrentCache(NamedTuple):
  """Decoding state of a recurrent block: constant size, whatever the sequence length."""

  rg_lru_state: Float[Array, "b e"]   # float32
  conv1d_state: Float[Array, "w b e"]  # the last temporal_width - 1 inputs (a ring, slot first)
  tokens: Int[Array, ""]  # tokens taken so far, the same for every row (the ring's index)


class RecurrentBlock(nnx.Module):
  """Two branches from ``width`` to ``lru_width``: Conv1D then RG-LRU, and GeLU; their
  product projected back to ``width``."""

  def __init__(self, width: int, lru_width: int, num_blocks: int, *, rngs: nnx.Rngs,
               conv1d_temporal_width: int = 4, final_init_scale: float = 1.0,
               scan_impl: str = "auto", fused_rg_lru: bool = False, gate_impl: str = "xla",
               conv1d_impl: str = "xla", decode_impl: str = "xla",
               a_init: tuple[float, float] = (0.9, 0.999), param_dtype=jnp.float32,
               dtype=jnp.float32):
    kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
    self.decode_impl = decode_impl  # xla | pallas: the one-token step (``decode_step``)
    self.linear_y = layers.Dense(width, lru_width, axes=("embed", "lru"), **kw)
    self.linear_x = layers.Dense(width, lru_width, axes=("embed", "lru"), **kw)
    self.linear_out = layers.Dense(lru_width, width, axes=("lru", "embed"),
                                   init_scale=final_init_scale, **kw)
    self.conv_1d = layers.Conv1D(lru_width, conv1d_temporal_width, impl=conv1d_impl, **kw)
    self.rg_lru = RGLRU(lru_width, num_blocks, scan_impl=scan_impl, fused=fused_rg_lru,
                        gate_impl=gate_impl, a_init=a_init, **kw)

  def __call__(
      self,
      x: Float[Array, "b t d"],
      segment_pos: Int[Array, "b t"],
      cache: RecurrentCache | None = None,
  ) -> tuple[Float[Array, "b t d"], RecurrentCache]:
    y = self.linear_y(x)
    x = self.linear_x(x)
    count = 0 if cache is None else cache.tokens
    if cache is not None and x.shape[1] == 1 and self._step_kernel(x.shape[0]):
      x, h_last, conv_state = self.decode_step(x, segment_pos, cache, y)  # x times gelu(y)
    else:
      x, conv_state = self.conv_1d(x, segment_pos, None if cache is None else cache.conv1d_state,
                                   count)
      x, h_last = self.rg_lru(x, segment_pos, None if cache is None else cache.rg_lru_state)
      x = x * jax.nn.gelu(y)
    return self.linear_out(x), RecurrentCache(h_last, conv_state,
                                              jnp.asarray(count + x.shape[1], jnp.int32))

  def _step_kernel(self, rows: int) -> bool:
    """Whether a one-token step of ``rows`` rows may take ``pallas_kernels.rg_lru.decode``
    (``decode_step`` asks again per device under a mesh)."""
    w = self.rg_lru.input_gate.w.value
    return (self.decode_impl == "pallas" and dispatch.triton_interpret() is not None
            and decode_kernel.worthwhile(rows, w.shape[0] * w.shape[1], w.shape[0]))

  def decode_step(self, x, segment_pos, cache: RecurrentCache, gate):
    """One token per row (``x``: ``linear_x``'s output, ``gate``: ``linear_y``'s, both
    ``[B, 1, E]``): XLA's Conv1D over the ring (which takes the token in place), then the gates,
    the RG-LRU update and the product with ``gelu(gate)`` in one kernel
    (``pallas_kernels.rg_lru.decode``), per device under a mesh; a device with fewer rows than
    ``decode.MIN_ROWS`` takes XLA's gates and update instead. Returns ``(y * gelu(gate)
    [B, 1, E], h [B, E], ring)``, as the XLA path."""
    lru = self.rg_lru
    x, ring = self.conv_1d(x, segment_pos, cache.conv1d_state, cache.tokens)

    def local(x, seg, w_x, w_a, b_x, b_a, a_param, h0, gate):
      if decode_kernel.worthwhile(x.shape[0], x.shape[1], w_x.shape[0]):
        return decode_kernel.gates_update(x, seg, w_x, w_a, b_x, b_a, a_param, h0, gate=gate,
                                          interpret=dispatch.triton_interpret())
      # XLA's step on this device's rows, as RGLRU takes one token
      x, gate_x, gate_a = lru.local_gates(x[:, None], w_x, w_a, b_x, b_a)
      y, h = one_token_update(x, gate_x, gate_a, a_param, seg[:, None] == 0, h0)
      return y[:, 0] * jax.nn.gelu(gate), h

    rows, lru_axes = ("batch", "lru"), ("lru",)
    # The gate blocks split over the mesh as the channels do: named "lru" too, so that the
    # channels split only where the blocks do (shard_local splits an axis name alike everywhere).
    blocks, block_bias = ("lru", None, None), ("lru", None)
    y, h = partitioning.shard_local(
        local, (rows, ("batch",), blocks, blocks, block_bias, block_bias, lru_axes, rows, rows),
        (rows, rows))(
            x[:, 0].astype(lru.dtype), segment_pos[:, 0], lru.input_gate.w.value,
            lru.a_gate.w.value, lru.input_gate.b.value, lru.a_gate.b.value, lru.a_param.value,
            cache.rg_lru_state, gate[:, 0].astype(lru.dtype))
    return y[:, None], h, ring

  def init_cache(self, batch_size: int, max_len: int, dtype) -> RecurrentCache:
    """The empty state: its size does not depend on ``max_len``."""
    del max_len
    width = self.rg_lru.a_param.value.shape[0]
    return RecurrentCache(
        jnp.zeros((batch_size, width), jnp.float32),
        jnp.zeros((self.conv_1d.temporal_width - 1, batch_size, width), dtype),
        jnp.zeros((), jnp.int32))
