"""The four Mosaic (TPU) kernels of chunk_gla; on a CPU they run in the TPU interpreter.

    states   (sequential over chunks)  the state at every chunk start, and the final state
    output   (parallel over chunks)    o from the chunk's inputs and its starting state
    dstates  (sequential, reversed)    d(state) at every chunk end, and d(initial state)
    grads    (parallel over chunks)    dq, dk, dv and the chunk-local part of d log_g

Layouts: TPU blocks tile the last two dimensions, so the token arrays are head-major
[B, H, T, X] and states [B, H, NT, V, K] (transposed, see chunk_math). The sequential kernels
walk the chunk axis as an "arbitrary" grid axis with the state in VMEM scratch.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gla import chunk_math

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Plan:
  """Chunk length C, and whether the kernels run in the TPU interpreter."""
  chunk: int
  interpret: bool = False

  def interpret_arg(self):
    return pltpu.InterpretParams() if self.interpret else False

  def params(self, n_grid, sequential_last=False):
    sem = ("parallel",) * (n_grid - 1) + ("arbitrary" if sequential_last else "parallel",)
    return pltpu.CompilerParams(dimension_semantics=sem)


def _tile_spec(plan, width):
  return pl.BlockSpec((None, None, plan.chunk, width), lambda b, h, n: (b, h, n, 0))


def _reset_specs(plan):
  return [pl.BlockSpec((None, plan.chunk, 1), lambda b, h, n: (b, n, 0)),
          pl.BlockSpec((None, None, 1, plan.chunk), lambda b, h, n: (b, n, 0, 0))]


def _state_spec(dv, dk):
  return pl.BlockSpec((None, None, None, dv, dk), lambda b, h, n: (b, h, n, 0, 0))


def _parallel_call(plan, kernel, tiles, states, resets, out_shape):
  """Runs `kernel` once per (batch, head, chunk) on chunk tiles and per-chunk states."""
  bsz, h, t, _ = tiles[0].shape
  grid = (bsz, h, t // plan.chunk)
  in_specs = [_tile_spec(plan, x.shape[-1]) for x in tiles]
  in_specs += [_state_spec(*s.shape[-2:]) for s in states]
  out_specs = [_tile_spec(plan, o.shape[-1]) for o in out_shape]
  if resets is not None:
    in_specs += _reset_specs(plan)
  args = (*tiles, *states, *(resets or ()))
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plan.params(3),
      interpret=plan.interpret_arg())(*args)


def output(plan, q, k, v, g, hs, resets, *, scale):
  """o [B, H, T, V] in q's dtype from q, k, g [B, H, T, K], v [B, H, T, V], hs [B, H, NT, V, K]."""
  out = jax.ShapeDtypeStruct(v.shape, q.dtype)
  kernel = functools.partial(chunk_math.output_kernel, scale=scale)
  (o,) = _parallel_call(plan, kernel, (q, k, v, g), (hs,), resets, [out])
  return o


def grads(plan, q, k, v, g, do, hs, dhs, resets, *, scale):
  """(dq, dk, dv, dgl): dgl float32, the chunk-local reverse cumulative sum of d log_g."""
  outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
          jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, F32)]
  kernel = functools.partial(chunk_math.grads_kernel, scale=scale)
  return _parallel_call(plan, kernel, (q, k, v, g, do), (hs, dhs), resets, outs)


def states(plan, k, v, g, s0, resets):
  """Forward state pass. s0 [B, H, V, K] float32 -> (hs [B, H, NT, V, K] in k's dtype, s_last)."""
  return _scan(plan, chunk_math.state_step, (k, v, g), s0, resets, reverse=False,
               out_dtype=k.dtype)


def dstates(plan, q, do, g, ds_last, resets, *, scale):
  """Backward state pass -> (dhs [B, H, NT, V, K]: d(state at each chunk end), ds0)."""
  step = functools.partial(chunk_math.dstate_step, scale=scale)
  return _scan(plan, step, (q, do, g), ds_last, resets, reverse=True, out_dtype=q.dtype)


def _scan(plan, step, xs, init, resets, *, reverse, out_dtype):
  """Runs `step(carry [V, K], *chunk_tiles, rc, rr)` over the chunks, storing each entering
  carry; the chunk axis is the last grid axis ("arbitrary"), the carry in VMEM scratch."""
  bsz, h, t, _ = xs[0].shape
  nt = t // plan.chunk
  dv, dk = init.shape[-2:]
  out_shape = [jax.ShapeDtypeStruct((bsz, h, nt, dv, dk), out_dtype),
               jax.ShapeDtypeStruct(init.shape, F32)]
  args = (*xs, init, *(resets or ()))
  chunk_of = (lambda n: nt - 1 - n) if reverse else (lambda n: n)
  tile = lambda w: pl.BlockSpec((None, None, plan.chunk, w),
                                lambda b, hh, n: (b, hh, chunk_of(n), 0))
  whole = pl.BlockSpec((None, None, dv, dk), lambda b, hh, n: (b, hh, 0, 0))
  in_specs = [tile(x.shape[-1]) for x in xs] + [whole]
  if resets is not None:
    in_specs += [pl.BlockSpec((None, plan.chunk, 1), lambda b, hh, n: (b, chunk_of(n), 0)),
                 pl.BlockSpec((None, None, 1, plan.chunk),
                              lambda b, hh, n: (b, chunk_of(n), 0, 0))]
  out_specs = [pl.BlockSpec((None, None, None, dv, dk),
                            lambda b, hh, n: (b, hh, chunk_of(n), 0, 0)), whole]
  n_x = len(xs)

  def kernel(*refs):
    x_refs, init_ref = refs[:n_x], refs[n_x]
    r_refs = refs[n_x + 1:n_x + 3] if resets is not None else (None, None)
    out_ref, last_ref, carry_ref = refs[-3:]
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
      carry_ref[...] = init_ref[...]

    out_ref[...] = carry_ref[...].astype(out_ref.dtype)
    r_vals = [None if r is None else r[...] for r in r_refs]
    carry_ref[...] = step(carry_ref[...], *(r[...] for r in x_refs), *r_vals)

    @pl.when(n == nt - 1)
    def _():
      last_ref[...] = carry_ref[...]

  return pl.pallas_call(
      kernel, grid=(bsz, h, nt), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((dv, dk), F32)],
      compiler_params=plan.params(3, sequential_last=True),
      interpret=plan.interpret_arg())(*args)
