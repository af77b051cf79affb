"""A pre-norm block's ``(s, rms_norm(s))`` with a one-pass backward (custom VJP).

``rms_norm_with_skip(x, scale, bias=None) -> (s, n)``: ``x: [..., D]``, ``bias: [D]`` or None;
``s = x + bias`` (in ``x``'s dtype) is the residual stream, returned for the block's skip
connection, and ``n = s / rms(s) * (1 + scale)`` in ``x``'s dtype, computed in float32. The
backward takes both cotangents, ``ds`` (the skip's) and ``dn``, and returns ``dx = ds + dn_s``
where ``dn_s`` is the normalisation's gradient, and the bias's gradient, the column sum of
``dx``::

    r = rsqrt(mean(s^2) + eps),  g = dn * (1 + scale)
    dn_s = r * g - s * r^3 * mean(g * s),   dscale = sum over rows of dn * s * r
    dbias = sum over rows of dx

XLA's autodiff of the jnp form spends two or three fusions on this: a row reduction reading
``dn`` and ``s``, then a pass reading ``dn``, ``s`` and ``ds`` that writes ``dx`` and reduces
the scale's gradient (on an H100 at Griffin-400M's shape, N = 32768, D = 1536: 0.28-0.34 ms a
norm, against 0.14 ms for the four ``[N, D]`` arrays at the copy ceiling; docs/performance.md).
Here one Triton program per 16 rows takes them one at a time, each held in registers: it reads
``s``, ``dn`` and ``ds`` once, writes ``dx``, and writes float32 partials of ``dscale`` and
``dbias`` per program, summed outside (``N / 16`` partials each, 1/8 of one ``[N, D]``
bfloat16 array). The bias is the output bias of the Dense layer that ends the residual branch
before the norm (``model.ResidualBlock``): taken by XLA, its gradient was one more reduction
pass over the ``dx`` just written, 0.82 ms for 23 norms of a Griffin-400M step (H100,
session-19 profile).

The forward is jnp (XLA fuses the statistics with the residual and bias adds before it).
Returning the skip from the same call is what lets the backward add its gradient in the same
pass.

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


def backward_reference(s, scale, ds, dn, eps: float):
  """``(dx, dscale, dbias)`` in float32 jnp for the stream ``s``: ``dx`` and ``dscale`` cast to
  the inputs' dtypes, ``dbias`` (the column sum of ``dx``) float32."""
  f32 = jnp.float32
  s32, dn32 = s.astype(f32), dn.astype(f32)
  r = jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
  g = dn32 * (scale.astype(f32) + 1.0)
  dx = ds.astype(f32) + r * g - s32 * r**3 * jnp.mean(g * s32, axis=-1, keepdims=True)
  columns = lambda a: jnp.sum(a.reshape(-1, s.shape[-1]), axis=0)
  return dx.astype(s.dtype), columns(dn32 * s32 * r).astype(scale.dtype), columns(dx)


def _bwd_kernel(x_ref, w_ref, ds_ref, dn_ref, dx_ref, dscale_ref, dbias_ref, *, n, d, cols,
                eps):
  # Whole arrays in. A program takes _ROWS rows one at a time; a row is held in registers as
  # D / cols chunks (D need not be a power of 2), so x and dn are read once.
  f32 = jnp.float32
  i = pl.program_id(0)
  chunks = [pl.ds(c * cols, cols) for c in range(d // cols)]
  weights = [plgpu.load(w_ref.at[c]).astype(f32) + 1.0 for c in chunks]

  def row_step(j, partials):
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
    scale_out, bias_out = [], []
    for c, x, g, w, p, q in zip(chunks, xs, gs, weights, *partials):
      dx = plgpu.load(ds_ref.at[row, c]).astype(f32) + r * g * w - x * k
      plgpu.store(dx_ref.at[row, c], dx.astype(dx_ref.dtype), mask=jnp.full((cols,), ok))
      scale_out.append(p + g * x * keep)
      bias_out.append(q + jnp.where(ok, dx, 0.0))
    return tuple(scale_out), tuple(bias_out)

  zeros = tuple(jnp.zeros((cols,), f32) for _ in chunks)
  dscale, dbias = jax.lax.fori_loop(0, _ROWS, row_step, (zeros, zeros))
  for c, p, q in zip(chunks, dscale, dbias):
    plgpu.store(dscale_ref.at[i, c], p)
    plgpu.store(dbias_ref.at[i, c], q)


def _backward_kernel(x, scale, ds, dn, eps, interpret):
  """``backward_reference``'s ``(dx, dscale, dbias)`` in one pass."""
  n, d = x.shape
  cols = next(c for c in _COLS if d % c == 0)
  blocks = pl.cdiv(n, _ROWS)
  partials = jax.ShapeDtypeStruct((blocks, d), jnp.float32)
  dx, dscale, dbias = pl.pallas_call(
      functools.partial(_bwd_kernel, n=n, d=d, cols=cols, eps=eps),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), partials, partials),
      grid=(blocks,),
      # 8 elements a thread: 16-byte loads of bfloat16
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=max(1, cols // 256)),
      interpret=interpret,
  )(x, scale, ds, dn)
  return dx, dscale.sum(axis=0).astype(scale.dtype), dbias.sum(axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, scale, bias, eps, interpret):
  s = x if bias is None else x + bias.astype(x.dtype)
  return s, forward(s, scale, eps)


def _norm_fwd(x, scale, bias, eps, interpret):
  s, n = _norm(x, scale, bias, eps, interpret)
  return (s, n), (s, scale, bias)


def _norm_bwd(eps, interpret, residuals, cotangents):
  s, scale, bias = residuals
  ds, dn = (c.astype(s.dtype) for c in cotangents)
  if supported(s.shape[-1]):
    dx, dscale, dbias = _backward_kernel(s, scale, ds, dn, eps, interpret)
  else:
    dx, dscale, dbias = backward_reference(s, scale, ds, dn, eps)
  return dx, dscale, None if bias is None else dbias.astype(bias.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def rms_norm_with_skip(x: jax.Array, scale: jax.Array, *, eps: float,
                       bias: jax.Array | None = None,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """``x: [..., D]``, ``scale: [D]``, ``bias: [D]`` or None -> ``(s, n)`` with ``s = x + bias``
  (see the module docstring). ``bias``'s gradient comes back in its own dtype."""
  if (x.ndim < 1 or scale.shape != (x.shape[-1],)
      or bias is not None and bias.shape != scale.shape):
    raise ValueError(f"rms_norm_with_skip takes x [..., D], scale [D] and bias [D] or None; got "
                     f"{x.shape}, {scale.shape} and {None if bias is None else bias.shape}")
  lead, d = x.shape[:-1], x.shape[-1]
  skip, n = _norm(x.reshape(-1, d), scale, bias, eps, interpret)
  return skip.reshape(*lead, d), n.reshape(*lead, d)
