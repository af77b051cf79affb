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
Here one Triton program per 16 rows takes them one at a time, each held in registers: it reads
``x``, ``dn`` and ``ds`` once, writes ``dx``, and writes a float32 partial of ``dscale`` per
program, summed outside (``N / 16`` partials, 1/8 of one ``[N, D]`` bfloat16 array).

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

_ROWS = 16                                   # rows per program, one at a time
_COLS = (1024, 512, 256, 128, 64, 32, 16)    # columns per load: the largest that divides D


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
  # Whole arrays in. A program takes _ROWS rows one at a time; a row is held in registers as
  # D / cols chunks (D need not be a power of 2), so x and dn are read once.
  f32 = jnp.float32
  i = pl.program_id(0)
  chunks = [pl.ds(c * cols, cols) for c in range(d // cols)]
  weights = [plgpu.load(w_ref.at[c]).astype(f32) + 1.0 for c in chunks]

  def row_step(j, partial):
    row = i * _ROWS + j
    ok = row < n
    row = jnp.minimum(row, n - 1)  # a row past the end reads the last one and writes nothing
    xs = [plgpu.load(x_ref.at[row, c]).astype(f32) for c in chunks]
    gs = [plgpu.load(dn_ref.at[row, c]).astype(f32) for c in chunks]
    sum_sq = sum(jnp.sum(x * x) for x in xs)
    sum_gx = sum(jnp.sum(g * w * x) for g, w, x in zip(gs, weights, xs))
    r = jax.lax.rsqrt(sum_sq / d + eps)
    k = sum_gx / d * r * r * r
    keep = jnp.where(ok, r, 0.0)
    out = []
    for c, x, g, w, p in zip(chunks, xs, gs, weights, partial):
      dx = plgpu.load(ds_ref.at[row, c]).astype(f32) + r * g * w - x * k
      plgpu.store(dx_ref.at[row, c], dx.astype(dx_ref.dtype), mask=jnp.full((cols,), ok))
      out.append(p + g * x * keep)
    return tuple(out)

  zeros = tuple(jnp.zeros((cols,), f32) for _ in chunks)
  partial = jax.lax.fori_loop(0, _ROWS, row_step, zeros)
  for c, p in zip(chunks, partial):
    plgpu.store(part_ref.at[i, c], p)


def _backward_kernel(x, scale, ds, dn, eps, interpret):
  n, d = x.shape
  cols = next(c for c in _COLS if d % c == 0)
  blocks = pl.cdiv(n, _ROWS)
  dx, partials = pl.pallas_call(
      functools.partial(_bwd_kernel, n=n, d=d, cols=cols, eps=eps),
      name="pallas_rms_norm_bwd",
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((blocks, d), jnp.float32)),
      grid=(blocks,),
      # 8 elements a thread: 16-byte loads of bfloat16
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=max(1, cols // 256)),
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
