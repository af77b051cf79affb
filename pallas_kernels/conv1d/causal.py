"""The recurrent block's causal Conv1D over time, reset at documents, with a one-pass backward.

``causal_conv1d(x, w, b, doc) -> y`` with ``x: [B, T, D]``, ``w: [W, D]`` (``W`` taps),
``b: [D]``, ``doc: [B, T]`` int document numbers (``layers.document_ids``)::

    y[t] = b + sum_{s < W} w[W-1-s] * x[t-s]   over the taps with t-s >= 0 and doc[t-s] == doc[t]

in ``x``'s dtype. ``forward`` is the same sum over a sequence with a history in front (the
decoding cache's last inputs); ``layers.Conv1D`` computes with it on every path.

Autodiff of that sum gave one multi-output XLA fusion per layer that read the output gradient
and the input at each of the ``W`` shifts and reduced the tap gradients in bfloat16; on an H100
it took 0.32 ms a layer at Griffin-400M's shape (plus 0.24 ms of follow-up passes) against 0.14 ms
for its bytes (docs/bench/performance_log.md, session 15). The backward here is one Triton
kernel; a program walks ``[rows, cols]`` tiles of one row ``b`` down the time axis: with
``u = t + s``,

    dx[t]        = sum_s w[W-1-s] * dy[u] * [doc[u] == doc[t], u < T]
    dw[W-1-s]   += sum_t x[t] * dy[u] * [doc[u] == doc[t], u < T]
    db          += sum_t dy[t]

so it reads ``x`` once, ``dy`` at ``W`` forward shifts of the same tile (cache hits), writes
``dx``, and keeps ``dw``'s and ``db``'s terms as float32 ``[rows, cols]`` sums in registers,
reduced over the rows and written once a program, summed outside.

``interpret=True``: Pallas' interpreter (the CPU tests). ``backward_reference`` is the same
backward in jnp (float32), the path where ``supported`` says no.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# A program: _STEPS tiles of _ROWS time rows, one after another, by _COLS channels. On an H200
# 16 x 64 x 16 tiles took 0.210 / 0.149 / 0.208 ms at Griffin 400M's / 1.3B's / 400M-at-8192's
# shapes, against 0.289 / 0.191 / 0.286 for one 32 x 128 tile a program with the tap sums
# reduced per tile (docs/bench/performance_log.md, session 39).
_ROWS = 16
_STEPS = 16
_COLS = (64, 32, 16)             # the largest that divides D
_WARPS = 4


def supported(d: int) -> bool:
  """Whether the kernel takes ``d`` channels (any ``B`` and ``T``): a multiple of 16."""
  return d % 16 == 0


def forward(padded, doc, w, b):
  """The convolution of the last ``T`` rows of ``padded: [B, H + T, D]`` (``H >= W - 1`` rows
  of history first), ``doc: [B, H + T]`` their document numbers (history rows that belong to no
  document: a number no token has, such as -1). In ``padded``'s dtype."""
  dtype = padded.dtype
  w, b = w.astype(dtype), b.astype(dtype)
  width = w.shape[0]
  t = padded.shape[1] - (width - 1)
  out = jnp.zeros((padded.shape[0], t, padded.shape[2]), dtype)
  for shift in range(min(width, t + width - 1)):
    start = width - 1 - shift
    same_doc = doc[:, start: start + t] == doc[:, width - 1:]
    out = out + jnp.where(same_doc[..., None], padded[:, start: start + t], 0) * w[start]
  return out + b


def with_empty_history(x, doc, width):
  """``forward``'s inputs for a sequence with nothing before it: ``W - 1`` zero rows in front of
  ``x: [B, T, D]``, and document number -1 (no token's) for them in front of ``doc``."""
  padded = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
  doc = jnp.pad(doc, ((0, 0), (width - 1, 0)), constant_values=-1)
  return padded, doc


def reference(x, w, b, doc):
  """``causal_conv1d``'s value in jnp (``forward`` over an empty history), for checks."""
  return forward(*with_empty_history(x, doc, w.shape[0]), w, b)


def backward_reference(x, w, b, doc, dy):
  """``(dx, dw, db)`` of ``causal_conv1d`` in float32 jnp, cast to the inputs' dtypes."""
  f32 = jnp.float32
  width, t = w.shape[0], x.shape[1]
  dy32 = jnp.pad(dy.astype(f32), ((0, 0), (0, width - 1), (0, 0)))
  doc_ahead = jnp.pad(doc, ((0, 0), (0, width - 1)), constant_values=-2)
  dx = jnp.zeros(x.shape, f32)
  dw = []
  for s in range(width):
    term = jnp.where((doc_ahead[:, s: s + t] == doc)[..., None], dy32[:, s: s + t], 0.0)
    dx = dx + term * w[width - 1 - s].astype(f32)
    dw.append(jnp.sum(term * x.astype(f32), axis=(0, 1)))
  dw = jnp.stack(dw[::-1])
  return dx.astype(x.dtype), dw.astype(w.dtype), jnp.sum(dy32, axis=(0, 1)).astype(b.dtype)


def _index(i):  # a static index as an array (static ints trip the interpreter's discharge)
  return jnp.asarray(i, jnp.int32)


def _bwd_kernel(dy_ref, x_ref, w_ref, doc_ref, dx_ref, part_ref, *, T, width, rows, cols,
                steps):
  # Whole arrays in, no BlockSpecs: the rows a program reads overlap its neighbours' (the W
  # shifts), so each load names its rows and masks those past T. A program walks ``steps`` tiles
  # of ``rows`` down the time axis and keeps the tap and bias gradients as [rows, cols] sums in
  # registers, reduced over the rows once at the end.
  f32 = jnp.float32
  b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  channels = pl.ds(j * cols, cols)
  taps = [plgpu.load(w_ref.at[_index(width - 1 - s), channels]).astype(f32)[None, :]
          for s in range(width)]

  def tile(k, sums):
    t0 = (i * steps + k) * rows
    at = t0 + jnp.arange(rows)
    in_rows = at < T
    doc_t = plgpu.load(doc_ref.at[b, pl.ds(t0, rows)], mask=in_rows, other=-2)
    x_t = plgpu.load(x_ref.at[b, pl.ds(t0, rows), channels], mask=in_rows[:, None],
                     other=0.0).astype(f32)
    dx = jnp.zeros((rows, cols), f32)
    new = []
    for s in range(width):
      ahead = (at + s) < T
      doc_u = plgpu.load(doc_ref.at[b, pl.ds(t0 + s, rows)], mask=ahead, other=-3)
      dy_u = plgpu.load(dy_ref.at[b, pl.ds(t0 + s, rows), channels], mask=ahead[:, None],
                        other=0.0).astype(f32)
      if s == 0:  # the bias: every row's dy once
        db = sums[width] + dy_u
      term = jnp.where(((doc_u == doc_t) & in_rows)[:, None], dy_u, 0.0)
      dx += term * taps[s]
      new.append(sums[s] + term * x_t)
    plgpu.store(dx_ref.at[b, pl.ds(t0, rows), channels], dx.astype(dx_ref.dtype),
                mask=in_rows[:, None])
    return (*new, db)

  zeros = tuple(jnp.zeros((rows, cols), f32) for _ in range(width + 1))
  sums = jax.lax.fori_loop(0, steps, tile, zeros)
  for s in range(width):
    plgpu.store(part_ref.at[b, i, _index(width - 1 - s), channels], jnp.sum(sums[s], axis=0))
  plgpu.store(part_ref.at[b, i, _index(width), channels], jnp.sum(sums[width], axis=0))


def _backward_kernel(x, w, doc, dy, interpret):
  bsz, t, d = x.shape
  width = w.shape[0]
  rows, cols = _ROWS, next(c for c in _COLS if d % c == 0)
  steps = min(_STEPS, pl.cdiv(t, rows))
  blocks = pl.cdiv(t, rows * steps)
  dx, partials = pl.pallas_call(
      functools.partial(_bwd_kernel, T=t, width=width, rows=rows, cols=cols, steps=steps),
      name="pallas_conv1d_bwd",
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((bsz, blocks, width + 1, d), jnp.float32)),
      grid=(bsz, blocks, d // cols),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=_WARPS),
      interpret=interpret,
  )(dy, x, w, doc)
  sums = partials.sum(axis=(0, 1))
  return dx, sums[:width], sums[width]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv(x, w, b, doc, interpret):
  return reference(x, w, b, doc)


def _conv_fwd(x, w, b, doc, interpret):
  return _conv(x, w, b, doc, interpret), (x, w, b, doc)


def _conv_bwd(interpret, residuals, dy):
  x, w, b, doc = residuals
  if supported(x.shape[-1]):
    dx, dw, db = _backward_kernel(x, w, doc, dy.astype(x.dtype), interpret)
    dw, db = dw.astype(w.dtype), db.astype(b.dtype)
  else:
    dx, dw, db = backward_reference(x, w, b, doc, dy)
  return dx, dw, db, None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv1d(x: jax.Array, w: jax.Array, b: jax.Array, doc: jax.Array, *,
                  interpret: bool = False) -> jax.Array:
  """``x: [B, T, D]``, ``w: [W, D]``, ``b: [D]``, ``doc: [B, T]`` int -> ``[B, T, D]`` (see the
  module docstring). ``w`` and ``b`` may be float32 parameters: they are cast to ``x``'s dtype
  for the sum, and their gradients come back in their own dtype."""
  if x.ndim != 3 or w.ndim != 2 or w.shape[1] != x.shape[2] or b.shape != (x.shape[2],) \
      or doc.shape != x.shape[:2]:
    raise ValueError(f"causal_conv1d takes x [B, T, D], w [W, D], b [D], doc [B, T]; got "
                     f"{x.shape}, {w.shape}, {b.shape}, {doc.shape}")
  return _conv(x, w, b, doc.astype(jnp.int32), interpret)
