"""A pre-norm block's ``(x, rms_norm(x))`` with a one-pass backward (custom VJP).

``rms_norm_with_skip(x, scale) -> (x, n)``: ``x: [..., D]`` the residual stream, returned as it
is (the block's skip connection), and ``n = x / rms(x) * (1 + scale)`` in ``x``'s dtype,
computed in float32. The backward takes both cotangents, ``ds`` (the skip's) and ``dn``, and
returns ``dx = ds + dn_x`` where ``dn_x`` is the normalisation's gradient::

    r = rsqrt(mean(x^2) + eps),  g = dn * (1 + scale)
    dn_x = r * g - x * r^3 * mean(g * x),   dscale = sum over rows of dn * x * r

XLA's autodiff of the jnp form spends two or three fusions on this: a row reduction reading
``dn`` and ``x``, then a pass reading ``dn``, ``x`` and ``ds`` that writes ``dx`` and reduces
the scale's gradient (on an H100 at Griffin-400M's shape, N = 32768, D = 1536: 0.28-0.34 ms a
norm, against 0.14 ms for the four ``[N, D]`` arrays at the copy ceiling; docs/performance.md).
Here one Triton program per 32 rows reads each row's ``x`` and ``dn`` twice (once for the two
row sums, once for the outputs; the second read hits the L2 cache), ``ds`` once, writes ``dx``
and a float32 partial of ``dscale`` per program, summed outside (``N / 32`` partials).

The forward is jnp (XLA fuses the statistics with the residual add before it). Returning the
skip from the same call is what lets the backward add its gradient in the same pass.

``interpret=True``: Pallas' interpreter (the CPU tests). ``backward_reference`` is the same
backward in float32 jnp: the path where ``supported`` says no.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_ROWS = 32                                   # rows per program
_COLS = (256, 128, 64, 32, 16)               # columns per load: the largest that divides D


def supported(d: int) -> bool:
  """Whether the kernel takes rows of width ``d`` (any number of rows): a multiple of 16."""
  return d % 16 == 0


def forward(x, scale, eps: float):
  """``x / rms(x) * (1 + scale)`` over the last axis, in float32, cast to ``x``'s dtype."""
  acc = jnp.promote_types(x.dtype, jnp.float32)
  x32 = x.astype(acc)
  var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  normed = x32 * jax.lax.rsqrt(var + eps)
  return (normed * (scale.astype(acc) + 1.0)).astype(x.dtype)


def backward_reference(x, scale, ds, dn, eps: float):
  """``(dx, dscale)`` in float32 jnp, cast to the inputs' dtypes."""
  f32 = jnp.float32
  x32, dn32 = x.astype(f32), dn.astype(f32)
  r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  g = dn32 * (scale.astype(f32) + 1.0)
  dx = ds.astype(f32) + r * g - x32 * r**3 * jnp.mean(g * x32, axis=-1, keepdims=True)
  dscale = jnp.sum((dn32 * x32 * r).reshape(-1, x.shape[-1]), axis=0)
  return dx.astype(x.dtype), dscale.astype(scale.dtype)


def _bwd_kernel(x_ref, w_ref, ds_ref, dn_ref, dx_ref, part_ref, *, n, d, cols, eps):
  # Whole arrays in: a program loops over its rows' column chunks (D need not be a power of 2).
  f32 = jnp.float32
  i = pl.program_id(0)
  r0 = i * _ROWS
  valid = (r0 + jnp.arange(_ROWS) < n)[:, None]
  rows = pl.ds(r0, _ROWS)

  def load(ref, c):
    return plgpu.load(ref.at[rows, pl.ds(c * cols, cols)], mask=valid, other=0.0).astype(f32)

  def weight(c):
    return plgpu.load(w_ref.at[pl.ds(c * cols, cols)]).astype(f32)[None, :] + 1.0

  sum_sq = jnp.zeros((_ROWS,), f32)
  sum_gx = jnp.zeros((_ROWS,), f32)
  for c in range(d // cols):
    x = load(x_ref, c)
    sum_sq += jnp.sum(x * x, axis=1)
    sum_gx += jnp.sum(load(dn_ref, c) * weight(c) * x, axis=1)
  r = jax.lax.rsqrt(sum_sq / d + eps)[:, None]
  k = (sum_gx / d)[:, None] * r * r * r
  for c in range(d // cols):
    x, dn = load(x_ref, c), load(dn_ref, c)
    dx = load(ds_ref, c) + r * (dn * weight(c)) - x * k
    plgpu.store(dx_ref.at[rows, pl.ds(c * cols, cols)], dx.astype(dx_ref.dtype), mask=valid)
    plgpu.store(part_ref.at[i, pl.ds(c * cols, cols)], jnp.sum(dn * x * r, axis=0))


def _backward_kernel(x, scale, ds, dn, eps, interpret):
  n, d = x.shape
  cols = next(c for c in _COLS if d % c == 0)
  blocks = pl.cdiv(n, _ROWS)
  dx, partials = pl.pallas_call(
      functools.partial(_bwd_kernel, n=n, d=d, cols=cols, eps=eps),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((blocks, d), jnp.float32)),
      grid=(blocks,),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4),
      interpret=interpret,
  )(x, scale, ds, dn)
  return dx, partials.sum(axis=0).astype(scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _norm(x, scale, eps, interpret):
  return x, forward(x, scale, eps)


def _norm_fwd(x, scale, eps, interpret):
  return _norm(x, scale, eps, interpret), (x, scale)


def _norm_bwd(eps, interpret, residuals, cotangents):
  x, scale = residuals
  ds, dn = (c.astype(x.dtype) for c in cotangents)
  if not supported(x.shape[-1]):
    return backward_reference(x, scale, ds, dn, eps)
  return _backward_kernel(x, scale, ds, dn, eps, interpret)


_norm.defvjp(_norm_fwd, _norm_bwd)


def rms_norm_with_skip(x: jax.Array, scale: jax.Array, *, eps: float,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x: [..., D]``, ``scale: [D]`` -> ``(x, n)`` (see the module docstring)."""
  if x.ndim < 1 or scale.shape != (x.shape[-1],):
    raise ValueError(f"rms_norm_with_skip takes x [..., D] and scale [D]; got {x.shape} and "
                     f"{scale.shape}")
  lead, d = x.shape[:-1], x.shape[-1]
  skip, n = _norm(x.reshape(-1, d), scale, eps, interpret)
  return skip.reshape(*lead, d), n.reshape(*lead, d)
