"""pallas_call set-up of the four GLA kernels for TPU (Mosaic) and GPU (Triton).

    states   (sequential over chunks)  the state at every chunk start, and the final state
    output   (parallel over chunks)    o from the chunk's inputs and its starting state
    dstates  (sequential, reversed)    d(state) at every chunk end, and d(initial state)
    grads    (parallel over chunks)    dq, dk, dv and the chunk-local part of d log_g

Layouts: TPU blocks must tile the last two dimensions, so there the token arrays are head-major
[B, H, T, X]; the Triton kernels read the caller's [B, T, H, X] directly (a strided tile), which
saves a transpose of every input and output. States are [B, H, NT, V, K] (transposed, see
gla_chunk). The sequential kernels carry the state differently: on TPU the chunk axis is an
"arbitrary" grid axis with the state in VMEM scratch; Triton has no scratch that survives grid
steps, so there one program walks all chunks in a loop and the state is split into [BV, BK]
tiles (its K and V columns evolve independently) to give the GPU enough programs.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import gla_chunk

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Plan:
  """How to run: platform 'tpu' or 'gpu' (decides layout and lowering), chunk length C."""
  platform: str
  chunk: int
  interpret: bool = False

  @property
  def head_major(self) -> bool:
    return self.platform == "tpu"

  def interpret_arg(self):
    if not self.interpret:
      return False
    return pltpu.InterpretParams() if self.platform == "tpu" else True

  def params(self, n_grid, sequential_last=False, warps=4, stages=2):
    if self.platform == "tpu":
      sem = ("parallel",) * (n_grid - 1) + ("arbitrary" if sequential_last else "parallel",)
      return pltpu.CompilerParams(dimension_semantics=sem)
    return pltr.CompilerParams(num_warps=warps, num_stages=stages)


def dims(plan: Plan, x):
  """(B, T, H, X) of a token array in the plan's layout."""
  if plan.head_major:
    b, h, t, d = x.shape
  else:
    b, t, h, d = x.shape
  return b, t, h, d


def _tile_spec(plan, width):
  if plan.head_major:
    return pl.BlockSpec((None, None, plan.chunk, width), lambda b, h, n: (b, h, n, 0))
  return pl.BlockSpec((None, plan.chunk, None, width), lambda b, h, n: (b, n, h, 0))


def _reset_specs(plan):
  return [pl.BlockSpec((None, plan.chunk, 1), lambda b, h, n: (b, n, 0)),
          pl.BlockSpec((None, None, 1, plan.chunk), lambda b, h, n: (b, n, 0, 0))]


def _state_spec(dv, dk):
  return pl.BlockSpec((None, None, None, dv, dk), lambda b, h, n: (b, h, n, 0, 0))


def _parallel_call(plan, kernel, tiles, states, resets, out_shape):
  """Runs `kernel` once per (batch, head, chunk) on chunk tiles and per-chunk states."""
  bsz, t, h, _ = dims(plan, tiles[0])
  grid = (bsz, h, t // plan.chunk)
  in_specs = [_tile_spec(plan, x.shape[-1]) for x in tiles]
  in_specs += [_state_spec(*s.shape[-2:]) for s in states]
  out_specs = [_tile_spec(plan, o.shape[-1]) for o in out_shape]
  if resets is not None:
    in_specs += _reset_specs(plan)
  args = (*tiles, *states, *(resets or ()))
  width = max(tiles[0].shape[-1], tiles[2].shape[-1])
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plan.params(3, warps=4 if width <= 64 else 8, stages=1),
      interpret=plan.interpret_arg())(*args)


def output(plan, q, k, v, g, hs, resets, *, scale):
  """o [layout of v] in q's dtype from q, k, g [.., K], v [.., V], hs [B, H, NT, V, K]."""
  out = jax.ShapeDtypeStruct(v.shape, q.dtype)
  kernel = functools.partial(gla_chunk.output_kernel, scale=scale)
  (o,) = _parallel_call(plan, kernel, (q, k, v, g), (hs,), resets, [out])
  return o


def grads(plan, q, k, v, g, do, hs, dhs, resets, *, scale):
  """(dq, dk, dv, dgl): dgl float32, the chunk-local reverse cumulative sum of d log_g."""
  outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
          jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(g.shape, F32)]
  kernel = functools.partial(gla_chunk.grads_kernel, scale=scale)
  return _parallel_call(plan, kernel, (q, k, v, g, do), (hs, dhs), resets, outs)


def states(plan, k, v, g, s0, resets):
  """Forward state pass. s0 [B, H, V, K] float32 -> (hs [B, H, NT, V, K] in k's dtype, s_last)."""
  return _scan(plan, gla_chunk.state_step, (k, v, g), ("k", "v", "k"), s0, resets,
               reverse=False, out_dtype=k.dtype)


def dstates(plan, q, do, g, ds_last, resets, *, scale):
  """Backward state pass -> (dhs [B, H, NT, V, K]: d(state at each chunk end), ds0)."""
  step = functools.partial(gla_chunk.dstate_step, scale=scale)
  return _scan(plan, step, (q, do, g), ("k", "v", "k"), ds_last, resets,
               reverse=True, out_dtype=q.dtype)


def _scan(plan, step, xs, kinds, init, resets, *, reverse, out_dtype):
  """Runs `step(carry [V, K], *chunk_tiles, rc, rr)` over the chunks, storing each entering carry."""
  bsz, t, h, _ = dims(plan, xs[0])
  nt = t // plan.chunk
  dv, dk = init.shape[-2:]
  out_shape = [jax.ShapeDtypeStruct((bsz, h, nt, dv, dk), out_dtype),
               jax.ShapeDtypeStruct(init.shape, F32)]
  args = (*xs, init, *(resets or ()))
  if plan.platform == "tpu":
    return _scan_tpu(plan, step, xs, init, resets, out_shape, args, reverse)
  return _scan_gpu(plan, step, kinds, resets, out_shape, args, reverse, nt)


def _scan_tpu(plan, step, xs, init, resets, out_shape, args, reverse):
  bsz, t, h, _ = dims(plan, xs[0])
  nt = t // plan.chunk
  dv, dk = init.shape[-2:]
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


def _scan_gpu(plan, step, kinds, resets, out_shape, args, reverse, nt):
  bsz, h, _, dv, dk = out_shape[0].shape
  # Tiles of the state: enough programs to fill the GPU while keeping dots >= 16 wide.
  bv, bk = min(dv, 32), min(dk, 32)
  nkb = dk // bk
  n_x = len(kinds)
  c = plan.chunk

  def kernel(*refs):
    x_refs, init_ref = refs[:n_x], refs[n_x]
    rc_ref, rr_ref = refs[n_x + 1:n_x + 3] if resets is not None else (None, None)
    out_ref, last_ref = refs[-2:]
    b, hh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vcols, kcols = pl.ds((j // nkb) * bv, bv), pl.ds((j % nkb) * bk, bk)

    def body(i, carry):
      n = nt - 1 - i if reverse else i
      rows = pl.ds(n * c, c)
      xs = [r[b, rows, hh, kcols if kind == "k" else vcols] for r, kind in zip(x_refs, kinds)]
      r_vals = (None, None) if rc_ref is None else (rc_ref[b, rows, :], rr_ref[b, n, :, :])
      out_ref[b, hh, n, vcols, kcols] = carry.astype(out_ref.dtype)
      return step(carry, *xs, *r_vals)

    carry = jax.lax.fori_loop(0, nt, body, init_ref[b, hh, vcols, kcols])
    last_ref[b, hh, vcols, kcols] = carry

  return pl.pallas_call(
      kernel, grid=(bsz, h, (dv // bv) * nkb), out_shape=out_shape,
      compiler_params=plan.params(3, warps=4, stages=2),
      interpret=plan.interpret_arg())(*args)
