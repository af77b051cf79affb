"""Gated Linear Attention, chunkwise-parallel, with a custom VJP; dispatches by platform.

GPU: `gla_gpu` (batched products in XLA, the Pallas linear-scan kernel across chunks), unless
GPU_IMPL is "pallas". TPU (and GPU_IMPL "pallas"): the Pallas kernels of gla_calls. Forward: a
sequential pass computes the state at every chunk start (gla_calls.states), then every chunk's
output is computed in parallel from its inputs and its starting state. Backward (recomputing
those states rather than keeping them, as in the GLA paper): a reversed sequential pass gives
d(state) at every chunk end, then a parallel pass gives dq, dk, dv and the chunk-local part of
d log_g; the rest of d log_g (a reverse cumulative sum across chunks) is a small XLA
computation here.
"""

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels import gla_calls
from pallas_kernels import gla_gpu
from pallas_kernels import gla_gpu_fact
from pallas_kernels.gla_chunk import SUB
from pallas_kernels.gla_reference import (add_later_chunks, chunk_reset_counts, default_scale,
                                          gla_recurrent_step, gla_reference)

__all__ = ["chunk_gla", "gla_recurrent_step", "gla_reference"]

F32 = jnp.float32

# The GPU path: "fact" (gla_gpu_fact: four Triton kernels, chunk gates factorised about the
# midpoint; where its shapes are supported, else "xla"), "xla" (gla_gpu: batched products in
# XLA and the Pallas linear-scan kernel for the chunk recurrence) or "pallas" (the four Triton
# kernels of gla_calls, kept for comparison).
GPU_IMPL = os.environ.get("GLA_GPU_IMPL", "fact")


def chunk_gla(q, k, v, log_g, h0=None, *, scale=None, reset=None, chunk_size=64,
              interpret=False, platform=None):
  """Gated linear attention over whole sequences.

  S_t = Diag(exp(log_g_t)) S_{t-1} + k_t^T v_t,  o_t = scale * q_t S_t  (per batch row, head).

  Args:
    q, k, log_g: [B, T, H, K]; log_g <= 0 (log of the forget gate), any float dtype.
    v: [B, T, H, V].
    h0: [B, H, K, V] initial state (float32); zeros when None.
    scale: multiplies q; K**-0.5 when None.
    reset: [B, T] bool, True at the first token of each document of a packed row: the state
      is zeroed just before that token (for a model, `segment_pos == 0`). None: no resets.
    chunk_size: tokens per chunk, a multiple of 16 (a power of two on GPU); T need not be a
      multiple of it. Shorter sequences use a smaller chunk.
    interpret: run the Pallas kernels in interpret mode (always so on a CPU).
    platform: 'tpu' or 'gpu' kernels; None picks the default backend's (TPU ones on a CPU).
  Returns:
    o: [B, T, H, V] in q's dtype; h_last: [B, H, K, V] float32, the state after token T.
  Differentiable in q, k, v, log_g and h0.
  """
  bsz, t, h, dk = q.shape
  dv = v.shape[-1]
  if k.shape != q.shape or log_g.shape != q.shape or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"chunk_gla: q, k, log_g must share [B, T, H, K] and v [B, T, H, V]; got "
                     f"q {q.shape}, k {k.shape}, v {v.shape}, log_g {log_g.shape}")
  if h0 is not None and h0.shape != (bsz, h, dk, dv):
    raise ValueError(f"chunk_gla: h0 must be {(bsz, h, dk, dv)}, got {h0.shape}")
  if reset is not None and reset.shape != (bsz, t):
    raise ValueError(f"chunk_gla: reset must be {(bsz, t)}, got {reset.shape}")
  scale = default_scale(dk) if scale is None else float(scale)
  backend = jax.default_backend()
  platform = platform or ("gpu" if backend in ("gpu", "cuda", "rocm") else "tpu")
  plan = gla_calls.Plan(platform, _chunk_length(chunk_size, t, platform),
                        interpret=interpret or backend == "cpu")

  c = plan.chunk
  tp = -(-t // c) * c
  if platform == "gpu" and GPU_IMPL in ("fact", "xla"):
    pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))
    s0 = jnp.zeros((bsz, h, dk, dv), F32) if h0 is None else h0.astype(F32)
    rc = None if reset is None else chunk_reset_counts(pad(reset), c)
    args = (pad(q), pad(k.astype(q.dtype)), pad(v.astype(q.dtype)), pad(log_g), s0, rc)
    if GPU_IMPL == "fact" and gla_gpu_fact.supported(dk, dv, c, q.dtype, plan.interpret):
      o, s_last = gla_gpu_fact.gla(scale, c, plan.interpret, *args)
    else:
      o, s_last = gla_gpu.gla(scale, c, plan.interpret, gla_gpu.intra_impl(), *args)
    return o[:, :t], s_last
  # Triton tiles are powers of two (and dots at least 16 wide): pad K and V with zeros, which
  # leave the padded state rows/columns at zero.
  kp, vp = (_pow2(dk), _pow2(dv)) if platform == "gpu" else (dk, dv)
  dt = q.dtype

  def tokens(x, width, dtype):
    x = jnp.pad(x.astype(dtype), ((0, 0), (0, tp - t), (0, 0), (0, width - x.shape[-1])))
    return x.transpose(0, 2, 1, 3) if plan.head_major else x

  s0 = jnp.zeros((bsz, h, dk, dv), F32) if h0 is None else h0.astype(F32)
  s0 = jnp.pad(s0, ((0, 0), (0, 0), (0, kp - dk), (0, vp - dv))).swapaxes(-1, -2)
  resets = None
  if reset is not None:
    counts = chunk_reset_counts(jnp.pad(reset, ((0, 0), (0, tp - t))), c)
    resets = (counts[:, :, None], counts.reshape(bsz, tp // c, 1, c))
  g = tokens(log_g, kp, log_g.dtype)
  o, s_last = _gla(plan, scale, tokens(q, kp, dt), tokens(k, kp, dt), tokens(v, vp, dt), g, s0,
                   resets)
  if plan.head_major:
    o = o.transpose(0, 2, 1, 3)
  return o[:, :t, :, :dv], s_last.swapaxes(-1, -2)[:, :, :dk, :dv]


def _pow2(n):
  return max(16, 1 << (n - 1).bit_length())


def _chunk_length(chunk_size, t, platform):
  if chunk_size % SUB or (platform == "gpu" and chunk_size != _pow2(chunk_size)):
    raise ValueError(f"chunk_gla: chunk_size must be a multiple of {SUB}"
                     f"{' and a power of two on GPU' if platform == 'gpu' else ''}, "
                     f"got {chunk_size}")
  fit = _pow2(t) if platform == "gpu" else -(-t // SUB) * SUB
  return min(chunk_size, fit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gla(plan, scale, q, k, v, g, s0, resets):
  return _gla_fwd(plan, scale, q, k, v, g, s0, resets)[0]


def _gla_fwd(plan, scale, q, k, v, g, s0, resets):
  hs, s_last = gla_calls.states(plan, k, v, g, s0, resets)
  o = gla_calls.output(plan, q, k, v, g, hs, resets, scale=scale)
  return (o, s_last), (q, k, v, g, s0, resets, s_last)


def _gla_bwd(plan, scale, res, cts):
  q, k, v, g, s0, resets, s_last = res
  do, ds_last = cts
  hs, _ = gla_calls.states(plan, k, v, g, s0, resets)
  dhs, ds0 = gla_calls.dstates(plan, q, do, g, ds_last, resets, scale=scale)
  dq, dk, dv, dgl = gla_calls.grads(plan, q, k, v, g, do, hs, dhs, resets, scale=scale)
  return dq, dk, dv, _log_gate_grad(plan, dgl, ds_last, s_last).astype(g.dtype), ds0, None


def _log_gate_grad(plan, dgl, ds_last, s_last):
  """d log_g_t = sum over t' >= t of dL/dG_t' (G the cumulative log-gate).

  dgl already sums within the chunk; add the sums of all later chunks, and the final state's
  term (h_last holds exp(G_T) in every term, so dL/dG_T gets sum_v dh_last * h_last, which the
  reverse cumulative sum spreads to every position).
  """
  c = plan.chunk
  axis = 2 if plan.head_major else 1
  shape = dgl.shape
  split = shape[:axis] + (shape[axis] // c, c) + shape[axis + 1:]
  final = jnp.sum(ds_last * s_last, axis=-2)  # [B, H, K]
  final = final[:, :, None, :] if plan.head_major else final[:, None, :, :]
  return add_later_chunks(dgl.reshape(split), axis).reshape(shape) + final


_gla.defvjp(_gla_fwd, _gla_bwd)
