"""Mosaic (TPU) kernel of ``blocked.blocked_scan``; on the CPU it runs in TPU interpret mode.

Grid ``(batch tiles, channel tiles, time blocks)``: the first two are independent ("parallel"),
the time axis is walked in scan order ("arbitrary") so that the carries can stay in VMEM scratch
from one time block to the next. Pallas' pipeline streams ``[block_b, block_t, block_d]`` tiles
HBM <-> VMEM (double-buffered) while the kernel walks the tile 16 rows at a time: an aligned
16-row slab is loaded into vregs, the 16 steps run unrolled, and the slab of outputs is stored.

A partial last time block (T not a multiple of ``block_t``) is handled in the kernel: rows past T
hold garbage (NaN in interpret mode), so the carries are only updated on rows with t < T and the
slab loop stops at the last slab that holds a valid row. Partial channel / batch tiles need
nothing: their garbage lanes never mix with valid ones and Pallas drops their writes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Rows moved between VMEM and vregs at a time: a whole sublane tile for 32-bit (8 rows) and
# 16-bit (16 rows) data, so slab loads and stores are aligned.
SLAB = 16


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def tpu_scan(step, streams, carries0, *, out_dtypes, reverse, config, lookahead, rows, params,
             name):
  """``blocked.blocked_scan`` on TPU (arguments and results as documented there)."""
  B, T, D = streams[0].shape
  f32 = jnp.float32
  if config.block_t % SLAB or config.block_d % 128:
    raise ValueError(f"block_t must be a multiple of {SLAB} and block_d of 128: {config}")
  bb = min(B, config.block_b)
  bd = D if D <= config.block_d else config.block_d
  bt = min(config.block_t, _cdiv(T, SLAB) * SLAB)
  nb, nd, nt = _cdiv(B, bb), _cdiv(D, bd), _cdiv(T, bt)
  slabs_per_block = bt // SLAB
  last_edge_slab = _cdiv(T, SLAB) - 1
  delta = -1 if reverse else 1  # time offset of the lookahead row

  def tblk(k):
    return nt - 1 - k if reverse else k

  stream_spec = pl.BlockSpec((bb, bt, bd), lambda b, d, k: (b, tblk(k), d))
  vec_spec = pl.BlockSpec((bb, 1, bd), lambda b, d, k: (b, 0, d))
  in_specs = [stream_spec] * len(streams)
  inputs = list(streams)
  if lookahead is not None:
    look, boundary = lookahead
    # The slab just past this block in scan order: it holds the lookahead row of the block's
    # last step (clamped at the sequence ends, where the boundary value is used instead).
    if reverse:
      edge_index = lambda b, d, k: (b, jnp.maximum(tblk(k) * slabs_per_block - 1, 0), d)
    else:
      edge_index = lambda b, d, k: (
          b, jnp.minimum((tblk(k) + 1) * slabs_per_block, last_edge_slab), d)
    in_specs += [stream_spec, pl.BlockSpec((bb, SLAB, bd), edge_index), vec_spec]
    inputs += [look, look, boundary.astype(f32)[:, None, :]]
  in_specs += [pl.BlockSpec((bb, bt, 1), lambda b, d, k: (b, tblk(k), 0))] * len(rows)
  inputs += [r.astype(f32)[:, :, None] for r in rows]
  in_specs += [pl.BlockSpec((1, bd), lambda b, d, k: (0, d))] * len(params)
  inputs += [p.astype(f32)[None, :] for p in params]
  in_specs += [vec_spec] * len(carries0)
  inputs += [c.astype(f32)[:, None, :] for c in carries0]

  out_shape = [jax.ShapeDtypeStruct((B, T, D), dt) for dt in out_dtypes]
  out_shape += [jax.ShapeDtypeStruct((B, 1, D), f32)] * len(carries0)
  out_specs = [stream_spec] * len(out_dtypes) + [vec_spec] * len(carries0)

  kernel = functools.partial(
      _kernel, step=step, n_streams=len(streams), has_lookahead=lookahead is not None,
      n_rows=len(rows), n_params=len(params), n_carries=len(carries0),
      out_dtypes=tuple(out_dtypes), reverse=reverse, T=T, bt=bt, nt=nt, delta=delta,
      slabs_per_block=slabs_per_block)
  results = pl.pallas_call(
      kernel,
      name=name,
      out_shape=out_shape,
      grid=(nb, nd, nt),
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((bb, bd), f32)] * len(carries0),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if config.interpret else False,
  )(*inputs)
  n_out = len(out_dtypes)
  return tuple(results[:n_out]), tuple(c[:, 0, :] for c in results[n_out:])


def _kernel(*refs, step, n_streams, has_lookahead, n_rows, n_params, n_carries, out_dtypes,
            reverse, T, bt, nt, delta, slabs_per_block):
  refs = list(refs)

  def take(n):
    taken, refs[:n] = refs[:n], []
    return taken

  stream_refs = take(n_streams)
  look_ref, edge_ref, boundary_ref = take(3) if has_lookahead else (None, None, None)
  row_refs, param_refs, carry0_refs = take(n_rows), take(n_params), take(n_carries)
  out_refs, carry_out_refs, state_refs = take(len(out_dtypes)), take(n_carries), take(n_carries)
  f32 = jnp.float32

  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    for state, init in zip(state_refs, carry0_refs):
      state[...] = init[:, 0, :]

  t0 = ((nt - 1 - k) if reverse else k) * bt
  n_run = (jnp.minimum(T - t0, bt) + SLAB - 1) // SLAB  # slabs holding a row with t < T
  param_vals = [p[...] for p in param_refs]
  boundary = boundary_ref[:, 0, :] if has_lookahead else None

  def load_slab(ref, slab):
    return ref[:, pl.ds(pl.multiple_of(slab * SLAB, SLAB), SLAB), :].astype(f32)

  def lookahead_rows(jt):
    """The lookahead stream at rows ``r + delta`` for the 16 rows r of slab ``jt``."""
    cur = load_slab(look_ref, jt)
    if reverse:
      neighbour = load_slab(look_ref, jnp.maximum(jt - 1, 0))[:, SLAB - 1:, :]
      edge = edge_ref[:, SLAB - 1:, :].astype(f32)
      neighbour = jnp.where(jt > 0, neighbour, edge)
      return jnp.concatenate([neighbour, cur[:, :SLAB - 1]], axis=1)
    neighbour = load_slab(look_ref, jnp.minimum(jt + 1, slabs_per_block - 1))[:, :1, :]
    edge = edge_ref[:, :1, :].astype(f32)
    neighbour = jnp.where(jt + 1 < slabs_per_block, neighbour, edge)
    return jnp.concatenate([cur[:, 1:], neighbour], axis=1)

  def slab_body(j, carries):
    jt = n_run - 1 - j if reverse else j
    stream_vals = [load_slab(r, jt) for r in stream_refs]
    row_vals = [load_slab(r, jt) for r in row_refs]
    look_vals = lookahead_rows(jt) if has_lookahead else None
    out_rows = [[None] * SLAB for _ in out_dtypes]
    for i in (range(SLAB - 1, -1, -1) if reverse else range(SLAB)):
      t = t0 + jt * SLAB + i
      ins = [v[:, i, :] for v in stream_vals]
      if has_lookahead:
        t_look = t + delta
        inside = (t_look >= 0) & (t_look < T)
        ins.append(jnp.where(inside, look_vals[:, i, :], boundary))
      ins += [v[:, i, :] for v in row_vals]
      ins += param_vals
      new, outs = step(carries, tuple(ins))
      carries = tuple(jnp.where(t < T, n, c) for n, c in zip(new, carries))
      for rows_of_out, o in zip(out_rows, outs):
        rows_of_out[i] = o
    for ref, rows_of_out, dtype in zip(out_refs, out_rows, out_dtypes):
      start = pl.multiple_of(jt * SLAB, SLAB)
      ref[:, pl.ds(start, SLAB), :] = jnp.stack(rows_of_out, axis=1).astype(dtype)
    return carries

  carries = jax.lax.fori_loop(0, n_run, slab_body, tuple(s[...] for s in state_refs))
  for state, c in zip(state_refs, carries):
    state[...] = c

  @pl.when(k == nt - 1)
  def _():
    for out, state in zip(carry_out_refs, state_refs):
      out[:, 0, :] = state[...]
