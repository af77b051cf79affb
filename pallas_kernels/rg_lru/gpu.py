"""Triton (GPU) kernel of ``blocked.blocked_scan``.

One program per ``(batch row, block of 256 channels)``, 4 warps; it walks the whole time axis,
the carries in registers. The scan is memory bound and has little parallelism across programs
(B * D channels), so the kernel's job is to keep enough bytes in flight: rows are loaded
``chunk`` at a time and the loads of chunk k+1 are issued before chunk k is computed (software
pipelining by hand: the prefetched rows are part of the loop carry). Each row load is one
coalesced vector load of ``block_d`` channels; no row is read twice. Wide blocks matter: with
32-channel blocks (64-byte row pieces) the same kernel moved about a quarter less data per second.

The last ``T mod chunk`` steps (and, with a lookahead stream, the very last step, which reads the
boundary value) are unrolled after the loop, so the loop itself needs no time masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Measured on an H100 (docs/kernels.md): 256 channels (512 contiguous bf16 bytes per row load)
# and 4 warps, 2 channels per thread, beat 32 / 64 / 128 / 512-channel blocks; the chunk of
# rows in flight shrinks with the number of [B, T, D] streams a step reads (registers).
_BLOCK_D = 256
_NUM_WARPS = 4
_CHUNK_BY_STREAMS = {1: 32, 2: 32, 3: 16, 4: 16, 5: 8}


def _next_power_of_2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def gpu_scan(step, streams, carries0, *, out_dtypes, reverse, config, lookahead, rows, params,
             name):
  """``blocked.blocked_scan`` on GPU (arguments and results as documented there)."""
  B, T, D = streams[0].shape
  n_loaded = len(streams) + (lookahead is not None)
  block_d = min(config.gpu_block_d or _BLOCK_D, _next_power_of_2(D))
  chunk = config.gpu_chunk or _CHUNK_BY_STREAMS.get(n_loaded, 8)
  num_warps = config.gpu_num_warps or _NUM_WARPS
  f32 = jnp.float32

  inputs = list(streams)
  if lookahead is not None:
    inputs += [lookahead[0], lookahead[1].astype(f32)]
  inputs += [r.astype(f32) for r in rows]
  inputs += [p.astype(f32) for p in params]
  inputs += [c.astype(f32) for c in carries0]
  out_shape = [jax.ShapeDtypeStruct((B, T, D), dt) for dt in out_dtypes]
  out_shape += [jax.ShapeDtypeStruct((B, D), f32)] * len(carries0)

  kernel = functools.partial(
      _kernel, step=step, n_streams=len(streams), has_lookahead=lookahead is not None,
      n_rows=len(rows), n_params=len(params), n_carries=len(carries0),
      out_dtypes=tuple(out_dtypes), reverse=reverse, T=T, D=D, block_d=block_d, chunk=chunk,
      eviction=config.gpu_eviction, prefetch=config.gpu_prefetch or 1)
  results = pl.pallas_call(
      kernel,
      name=name,
      out_shape=out_shape,
      grid=(B, pl.cdiv(D, block_d)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=config.interpret,
  )(*inputs)
  n_out = len(out_dtypes)
  return tuple(results[:n_out]), tuple(results[n_out:])


def _kernel(*refs, step, n_streams, has_lookahead, n_rows, n_params, n_carries, out_dtypes,
            reverse, T, D, block_d, chunk, eviction, prefetch):
  refs = list(refs)

  def take(n):
    taken, refs[:n] = refs[:n], []
    return taken

  stream_refs = take(n_streams)
  look_ref, boundary_ref = take(2) if has_lookahead else (None, None)
  row_refs, param_refs, carry0_refs = take(n_rows), take(n_params), take(n_carries)
  out_refs, carry_out_refs = take(len(out_dtypes)), take(n_carries)
  f32 = jnp.float32

  b = pl.program_id(0)
  d0 = pl.program_id(1) * block_d
  channels = pl.ds(d0, block_d)
  mask = (d0 + jnp.arange(block_d)) < D if D % block_d else None

  def load(ref_at):
    if mask is None:
      return plgpu.load(ref_at, eviction_policy=eviction).astype(f32)
    return plgpu.load(ref_at, mask=mask, other=0.0, eviction_policy=eviction).astype(f32)

  def store(ref_at, value):
    plgpu.store(ref_at, value.astype(ref_at.dtype), mask=mask, eviction_policy=eviction)

  def time_of(s):  # scan position -> time index (an array: static ints trip the interpreter)
    return jnp.asarray(T - 1 - s if reverse else s, jnp.int32)

  delta = -1 if reverse else 1
  param_vals = [load(p.at[channels]) for p in param_refs]

  def load_step(s, last):
    t = time_of(s)
    ins = [load(r.at[b, t, channels]) for r in stream_refs]
    if has_lookahead:
      ins.append(load(boundary_ref.at[b, channels]) if last
                 else load(look_ref.at[b, t + delta, channels]))
    ins += [plgpu.load(r.at[b, t]) for r in row_refs]
    return ins

  def run_step(s, ins, carries):
    carries, outs = step(carries, tuple(ins) + tuple(param_vals))
    t = time_of(s)
    for ref, value in zip(out_refs, outs):
      store(ref.at[b, t, channels], value)
    return carries

  carries = tuple(load(c.at[b, channels]) for c in carry0_refs)
  # With a lookahead stream the last step reads the boundary value: it is peeled off below.
  n_body = T - 1 if has_lookahead else T
  n_chunks, n_tail = divmod(n_body, chunk)

  if n_chunks:
    def load_chunk(k):
      return [load_step(k * chunk + i, False) for i in range(chunk)]

    def chunk_body(k, state):
      carries, ahead = state  # the rows of chunks k .. k + prefetch - 1, already loaded
      # Issue the loads of chunk k + prefetch first so they are in flight during this chunk's
      # steps (clamped: the last iterations reload the last chunk, which is harmless).
      upcoming = load_chunk(jnp.minimum(k + prefetch, n_chunks - 1))
      for i, ins in enumerate(ahead[0]):
        carries = run_step(k * chunk + i, ins, carries)
      return carries, ahead[1:] + [upcoming]

    first = [load_chunk(jnp.minimum(i, n_chunks - 1)) for i in range(prefetch)]
    carries, _ = jax.lax.fori_loop(0, n_chunks, chunk_body, (carries, first))

  tail = [load_step(n_chunks * chunk + i, False) for i in range(n_tail)]
  for i, ins in enumerate(tail):
    carries = run_step(n_chunks * chunk + i, ins, carries)
  if has_lookahead:
    carries = run_step(T - 1, load_step(T - 1, True), carries)

  for ref, value in zip(carry_out_refs, carries):
    store(ref.at[b, channels], value)
