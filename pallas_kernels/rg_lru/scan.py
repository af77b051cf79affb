"""The linear scan ``h_t = a_t * h_{t-1} + x_t`` as a Pallas kernel with a custom VJP.

The backward is the same kind of kernel, run in the opposite direction:

    g_t = dy_t + a_{t+1} g_{t+1}   (g_T's term is the cotangent of h_last)
    dx_t = g_t,   da_t = g_t * h_{t-1},   dh0 = a_0 g_0

with the carry ``c = a_t * g_t`` so that each step reads ``a`` at its own row. ``h_{t-1}`` is the
forward output ``y`` read one row ahead in the backward's order (``h0`` at the sequence start):
the residuals are ``a``, ``y`` and ``h0``, nothing per step beyond what the backward reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.rg_lru import blocked
from pallas_kernels.rg_lru import gpu_mosaic


def _backward_step(carries, ins):
  (c,), (dy, a, h_prev) = carries, ins
  g = dy + c
  return (a * g,), (g, g * h_prev)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def linear_scan_with_config(x, a, h0, reverse: bool, config: blocked.ScanConfig):
  """``linear_scan`` with an explicit kernel configuration (``h0`` is required here).

  Args:
    x, a: ``[B, T, D]``.
    h0: ``[B, D]`` float32.
    reverse: scan from ``t = T-1`` down to 0.
    config: backend and block sizes.

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype, ``h_last: [B, D]`` float32.
  """
  return _forward(x, a, h0, reverse, config)[0]


def _forward(x, a, h0, reverse, config):
  if config.backend == "gpu" and config.gpu_forward == "mosaic" and gpu_mosaic.supports(x, a):
    y, h_last = gpu_mosaic.linear_scan_mgpu(x, a, h0, reverse=reverse,
                                            interpret=config.interpret)
  else:
    (y,), (h_last,) = blocked.blocked_scan(
        gpu_mosaic.linear_step, (x, a), (h0,), out_dtypes=(x.dtype,), reverse=reverse,
        config=config)
  return (y, h_last), (a, y, h0)


def _backward(reverse, config, residuals, cotangents):
  a, y, h0 = residuals
  dy, dh_last = cotangents
  (dx, da), (dh0,) = blocked.blocked_scan(
      _backward_step, (dy, a), (dh_last.astype(jnp.float32),), out_dtypes=(y.dtype, a.dtype),
      reverse=not reverse, config=config, lookahead=(y, h0))
  return dx, da, dh0.astype(h0.dtype)


linear_scan_with_config.defvjp(_forward, _backward)


def linear_scan(x, a, h0=None, *, reverse=False, interpret=False):
  """``h_t = a_t * h_{t-1} + x_t`` (``h_{t+1}`` when ``reverse``), float32 accumulation.

  Args:
    x, a: ``[B, T, D]``, float32 or bfloat16 (they may differ).
    h0: ``[B, D]`` float32 or None (zeros): the state before the first step in scan order.
    reverse: scan from ``t = T-1`` down to 0.
    interpret: run the TPU kernel in TPU interpret mode (also chosen on a CPU target).

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype and ``h_last: [B, D]`` float32, the state after the last
    step. Differentiable in ``x``, ``a`` and ``h0``.
  """
  if x.ndim != 3 or a.shape != x.shape:
    raise ValueError(f"x and a must be [B, T, D] of one shape: {x.shape}, {a.shape}")
  if h0 is None:
    h0 = jnp.zeros((x.shape[0], x.shape[2]), jnp.float32)
  elif h0.shape != (x.shape[0], x.shape[2]):
    raise ValueError(f"h0 must be [B, D] = {(x.shape[0], x.shape[2])}: {h0.shape}")
  return linear_scan_with_config(x, a, h0.astype(jnp.float32), reverse,
                                 dispatch.scan_config(interpret))
