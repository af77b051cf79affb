"""Pure-JAX references for the RG-LRU kernels: what the Pallas kernels must compute.

They are written the plain way (``lax.scan`` over time, the gating math unfused) so that
``jax.grad`` through them gives independent reference gradients. Arithmetic runs in float32, or in
float64 when the inputs are float64 (the tests' high-precision reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# log a_t = -C * gate_a * softplus(a_param) (Griffin's c = 8).
RG_LRU_C = 8.0
# The derivative of sqrt(1 - a^2) is capped at this value (recurrentgemma's choice): the
# backward evaluates sqrt' at max(z, 1 / (4 * MAX_SQRT_GRADIENT^2)).
MAX_SQRT_GRADIENT = 1000.0


def _acc_dtype(*arrays):
  return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def linear_scan_reference(x, a, h0=None, *, reverse=False):
  """``h_t = a_t * h_{t-1} + x_t`` (``h_{t+1}`` when ``reverse``) with ``lax.scan``.

  Args:
    x, a: ``[B, T, D]``.
    h0: ``[B, D]`` or None (zeros): the state before the first step in scan order.
    reverse: scan from ``t = T-1`` down to 0.

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype and ``h_last: [B, D]`` in the accumulation dtype
    (float32, or float64 for float64 inputs).
  """
  acc = _acc_dtype(x, a) if h0 is None else _acc_dtype(x, a, h0)
  h = jnp.zeros((x.shape[0], x.shape[2]), acc) if h0 is None else h0.astype(acc)

  def step(h, xa):
    x_t, a_t = xa
    h = a_t.astype(acc) * h + x_t.astype(acc)
    return h, h

  xs = (jnp.swapaxes(x, 0, 1), jnp.swapaxes(a, 0, 1))
  h_last, hs = jax.lax.scan(step, h, xs, reverse=reverse)
  return jnp.swapaxes(hs, 0, 1).astype(x.dtype), h_last


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def sqrt_bounded_derivative(z, max_gradient):
  """``sqrt(z)`` whose backward uses ``sqrt'`` at ``max(z, 1 / (4 * max_gradient^2))``."""
  return jnp.sqrt(z)


def _sqrt_fwd(z, max_gradient):
  return jnp.sqrt(z), z


def _sqrt_bwd(max_gradient, z, g):
  z = jnp.maximum(z, 1.0 / (4.0 * max_gradient**2))
  return (0.5 * g / jnp.sqrt(z),)


sqrt_bounded_derivative.defvjp(_sqrt_fwd, _sqrt_bwd)


def rg_lru_reference(x, gate_x_logits, gate_a_logits, a_param, reset=None, h0=None,
                     *, scan_fn=linear_scan_reference):
  """The RG-LRU layer written unfused: gates, decay, normalisation, then a separate scan.

  Args:
    x, gate_x_logits, gate_a_logits: ``[B, T, D]``.
    a_param: ``[D]``; ``softplus(a_param) = -log(a) / C``.
    reset: bool ``[B, T]`` (True at a document's first token) or None.
    h0: ``[B, D]`` or None.
    scan_fn: the scan to use, ``(x, a, h0) -> (y, h_last)``.

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype and ``h_last: [B, D]`` (accumulation dtype).
  """
  acc = _acc_dtype(x, gate_x_logits, gate_a_logits, a_param)
  gate_x = jax.nn.sigmoid(gate_x_logits.astype(acc))
  gate_a = jax.nn.sigmoid(gate_a_logits.astype(acc))
  log_a = -RG_LRU_C * gate_a * jax.nn.softplus(a_param.astype(acc))
  a = jnp.exp(log_a)
  multiplier = sqrt_bounded_derivative(1.0 - jnp.exp(2.0 * log_a), MAX_SQRT_GRADIENT)
  if reset is not None:
    keep = 1.0 - reset.astype(acc)[..., None]
    multiplier = (1.0 - keep) + keep * multiplier
    a = a * keep
  normalized_x = x.astype(acc) * gate_x * multiplier
  if h0 is not None:
    h0 = h0.astype(acc)
  y, h_last = scan_fn(normalized_x, a, h0)
  return y.astype(x.dtype), h_last
