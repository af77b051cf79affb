"""Gated Linear Attention over whole sequences, chunkwise-parallel: the public entry point.

Which implementation runs is `pallas_kernels.dispatch.gla_path`:

- TPU (and the CPU, through the TPU interpreter): the Mosaic kernels of `gla.tpu`, under the
  custom VJP here. Forward: a sequential pass computes the state at every chunk start
  (`tpu.states`), then every chunk's output is computed in parallel from its inputs and its
  starting state. Backward (recomputing those states rather than keeping them, as in the GLA
  paper): a reversed sequential pass gives d(state) at every chunk end, then a parallel pass
  gives dq, dk, dv and the chunk-local part of d log_g; the rest of d log_g (a reverse
  cumulative sum across chunks) is a small XLA computation here.
- GPU: `gla.gpu` (five Triton kernels, the chunk gates factorised about the midpoint) where its
  shapes are supported, else `gla.gpu_xla` (batched products in XLA and the linear-scan kernel
  across chunks); each has its own custom VJP.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.gla import gpu
from pallas_kernels.gla import gpu_xla
from pallas_kernels.gla import tpu
from pallas_kernels.gla.chunk_math import SUB
from pallas_kernels.gla.reference import add_later_chunks, chunk_reset_counts, default_scale

F32 = jnp.float32


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
    interpret: run the Pallas kernels in interpret mode (always so on a CPU target).
    platform: 'tpu' or 'gpu' kernels; None: those of the platform being compiled for
      (dispatch.target_platform; the TPU kernels, interpreted, on a CPU).
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
  target = dispatch.target_platform()
  interpret = dispatch.interpret_on(target, interpret)
  platform = platform or ("gpu" if target == "gpu" else "tpu")  # a CPU runs the TPU kernels
  c = _chunk_length(chunk_size, t, platform)
  tp = -(-t // c) * c
  pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))
  counts = None if reset is None else chunk_reset_counts(pad(reset), c)
  path = dispatch.gla_path(platform, dk, dv, c, q.dtype, interpret)
  # Without h0, gla.gpu takes None (its kernels start from zeros without reading an array).
  if h0 is not None:
    s0 = h0.astype(F32)
  else:
    s0 = None if path == "gpu" else jnp.zeros((bsz, h, dk, dv), F32)
  if path in ("gpu", "gpu_xla"):
    args = (pad(q), pad(k.astype(q.dtype)), pad(v.astype(q.dtype)), pad(log_g), s0, counts)
    impl = gpu.gla if path == "gpu" else gpu_xla.gla
    o, s_last = impl(scale, c, interpret, *args)
    return o[:, :t], s_last
  # TPU: head-major [B, H, T, X] tiles (Mosaic blocks tile the last two dimensions) and the
  # state transposed, [B, H, V, K].
  dt = q.dtype
  tokens = lambda x, dtype: pad(x.astype(dtype)).transpose(0, 2, 1, 3)
  resets = None
  if counts is not None:
    resets = (counts[:, :, None], counts.reshape(bsz, tp // c, 1, c))
  plan = tpu.Plan(c, interpret)
  o, s_last = _gla(plan, scale, tokens(q, dt), tokens(k, dt), tokens(v, dt),
                   tokens(log_g, log_g.dtype), s0.swapaxes(-1, -2), resets)
  return o.transpose(0, 2, 1, 3)[:, :t], s_last.swapaxes(-1, -2)


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
  hs, s_last = tpu.states(plan, k, v, g, s0, resets)
  o = tpu.output(plan, q, k, v, g, hs, resets, scale=scale)
  return (o, s_last), (q, k, v, g, s0, resets, s_last)


def _gla_bwd(plan, scale, res, cts):
  q, k, v, g, s0, resets, s_last = res
  do, ds_last = cts
  hs, _ = tpu.states(plan, k, v, g, s0, resets)
  dhs, ds0 = tpu.dstates(plan, q, do, g, ds_last, resets, scale=scale)
  dq, dk, dv, dgl = tpu.grads(plan, q, k, v, g, do, hs, dhs, resets, scale=scale)
  return dq, dk, dv, _log_gate_grad(plan, dgl, ds_last, s_last).astype(g.dtype), ds0, None


def _log_gate_grad(plan, dgl, ds_last, s_last):
  """d log_g_t = sum over t' >= t of dL/dG_t' (G the cumulative log-gate).

  dgl already sums within the chunk; add the sums of all later chunks, and the final state's
  term (h_last holds exp(G_T) in every term, so dL/dG_T gets sum_v dh_last * h_last, which the
  reverse cumulative sum spreads to every position).
  """
  c = plan.chunk
  b, h, t, k = dgl.shape
  final = jnp.sum(ds_last * s_last, axis=-2)[:, :, None, :]  # [B, H, 1, K]
  return add_later_chunks(dgl.reshape(b, h, t // c, c, k), 2).reshape(dgl.shape) + final


_gla.defvjp(_gla_fwd, _gla_bwd)
