"""The RG-LRU layer fused into one pass over HBM, forward and backward (custom VJP).

Forward, per step (float32): ``gate_x = sigmoid(gx)``, ``gate_a = sigmoid(ga)``,
``log_a = -8 gate_a softplus(a_param)``, ``a = exp(log_a)``, ``mult = sqrt(1 - a^2)``; at a
reset token ``a = 0`` and ``mult = 1``; ``h_t = a_t h_{t-1} + x_t gate_x mult``. Only x, the two
gate logits and the reset flags are read and y written: the gates, ``a`` and the normalised
input never reach HBM.

Backward: the reverse scan of ``linear_scan`` (carry ``c = a_t g_t``) with the gate math
recomputed from the same inputs, so the residuals are the inputs, ``y`` and ``h0``. The
``a_param`` gradient is a sum over b and t; the kernel accumulates it over t in a second carry
and the sum over b happens outside. ``sqrt``'s derivative is evaluated at
``max(1 - a^2, 1 / (4 * 1000^2))`` (recurrentgemma's bound, keeping bfloat16 training finite).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch
from pallas_kernels.rg_lru import blocked
from pallas_kernels.rg_lru import gpu_mosaic
from pallas_kernels.rg_lru.reference import MAX_SQRT_GRADIENT, RG_LRU_C

_MIN_SQRT_ARG = 1.0 / (4.0 * MAX_SQRT_GRADIENT**2)


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# The Mosaic GPU forward (gpu_mosaic.mosaic_scan, Hopper and newer), the default there since
# session 19 (MOSAIC_FORWARD = False: the Triton forward). On an H100 at the Griffin-400M layer
# (B=16, T=2048, D=2048) it takes the forward from 0.36 ms (Triton) to 0.222 ms, and forward +
# backward to 0.706 ms, 76% of the bytes floor (docs/bench/kernels_log.md; 0.693 ms, 77%, in
# session 20: docs/kernels.md). In session 10 Griffin-400M's training step did not get faster
# with it (184.3 against 182.9 ms, run-to-run noise then) and its compile grew from 32 s to
# 95 s; in session 19's same-call A/B the step went from 171.3 to 169.5 ms and compiled in 76 s
# against 81 s. Its tiles: 128 channels per CUDA block (one per
# thread of its warpgroup), 32 time rows (the reset flags' float32 tile must be a multiple of 128
# bytes), 2 stages (a small shared-memory ring lets several blocks share an SM: 0.369 ms with 3
# stages, 0.241 with 2), rows looped 8 at a time (every row unrolled: 0.222 ms but 14.6 s to
# compile; 8: 0.227 ms, 2.4 s). With fewer than MOSAIC_MIN_BLOCKS blocks (about one per SM)
# the Triton forward, whose blocks narrow with the batch (gpu_block), runs instead: B=4, D=2048
# (64 blocks) took 1.155 ms with the Mosaic forward; at Griffin 1.3B's micro-batch (B=8,
# T=2048, D=2560: 160 blocks) it took 0.229 ms against Triton's 0.309, forward + backward 0.716
# against 0.804 (H100, session 27).
MOSAIC_FORWARD = True
MOSAIC_BLOCK_D, MOSAIC_ROWS, MOSAIC_STAGES, MOSAIC_MIN_BLOCKS = 128, 32, 2, 128
MOSAIC_ROW_UNROLL = 8


def _sigmoid(z):
  # exp2 is one special-function instruction on a GPU; jnp.exp lowers to libdevice's expf, which
  # adds a range reduction, and jax.nn.sigmoid to an IEEE division on top.
  return 1.0 / (1.0 + jnp.exp2(-_LOG2E * z))


def _gates(x_logit, a_logit, reset, softplus_a):
  """The gate math of one step, written for few GPU instructions (exp2, rsqrt, no IEEE sqrt):
  on an H100 this took the fused backward from 0.61 to 0.40 ms at the Griffin-400M layer shape
  (docs/kernels.md), at the same float64 errors."""
  gate_x = _sigmoid(x_logit)
  gate_a = _sigmoid(a_logit)
  log2_a = (-RG_LRU_C * _LOG2E) * gate_a * softplus_a
  a = jnp.exp2(log2_a)
  # 1 - a^2: as a -> 1 the subtraction cancels to a few float32 ulps (recurrentgemma has that
  # error), so near 0 a Taylor polynomial of 1 - exp(u), u = 2 log a, keeps float32 relative
  # precision (truncation below |u|^5 / 720); away from it 1 - a^2 < 0.905 does not cancel.
  u = (2.0 * _LN2) * log2_a
  series = -u * (1.0 + u * (1.0 / 2 + u * (1.0 / 6 + u * (1.0 / 24 + u * (1.0 / 120)))))
  one_minus_a_sq = jnp.where(u > -0.1, series, 1.0 - a * a)
  root = one_minus_a_sq * jax.lax.rsqrt(jnp.maximum(one_minus_a_sq, 1e-30))  # sqrt
  keep = 1.0 - reset
  mult = reset + keep * root
  return gate_x, gate_a, a * keep, one_minus_a_sq, mult, keep


def _forward_step(carries, ins):
  (h,), (x, x_logit, a_logit, reset, softplus_a) = carries, ins
  gate_x, _, a, _, mult, _ = _gates(x_logit, a_logit, reset, softplus_a)
  h = a * h + x * gate_x * mult
  return (h,), (h,)


def _backward_step(carries, ins):
  (c, acc), (dy, x, x_logit, a_logit, h_prev, reset, softplus_a) = carries, ins
  gate_x, gate_a, a, one_minus_a_sq, mult, keep = _gates(x_logit, a_logit, reset, softplus_a)
  g = dy + c  # d loss / d h_t
  g_x = g * x
  dx = g * gate_x * mult
  dx_logit = g_x * mult * gate_x * (1.0 - gate_x)
  # d/dlog_a of a (= a) and of mult (= -a^2 / sqrt(1 - a^2), with the bounded sqrt'); zero at a
  # reset, where a and mult are constants.
  d_mult = g_x * gate_x
  d_log_a = keep * (g * h_prev * a - d_mult * (1.0 - one_minus_a_sq)
                    * jax.lax.rsqrt(jnp.maximum(one_minus_a_sq, _MIN_SQRT_ARG)))
  da_logit = d_log_a * (-RG_LRU_C * softplus_a) * gate_a * (1.0 - gate_a)
  acc = acc + d_log_a * (-RG_LRU_C * gate_a)  # d loss / d softplus(a_param), summed over t
  return (a * g, acc), (dx, dx_logit, da_logit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def rg_lru_with_config(x, gate_x_logits, gate_a_logits, a_param, reset, h0,
                       config: blocked.ScanConfig):
  """``rg_lru`` with an explicit kernel configuration; ``reset`` float ``[B, T]`` and ``h0``
  ``[B, D]`` float32 are required here (see ``rg_lru`` for the rest)."""
  return _forward(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config)[0]


def _blocks(rows: int, width: int) -> int:
  """Blocks of ``MOSAIC_BLOCK_D`` (128) channels of ``rows`` rows: the Mosaic forward's CUDA
  blocks, and the Triton kernels' programs at 128 channels."""
  return rows * -(-width // MOSAIC_BLOCK_D)


def mosaic_forward_has_blocks(batch: int, width: int) -> bool:
  """Whether ``[batch, T, width]`` gives the Mosaic GPU forward ``MOSAIC_MIN_BLOCKS`` blocks
  (one per row and ``MOSAIC_BLOCK_D`` channels); fewer run the Triton forward."""
  return _blocks(batch, width) >= MOSAIC_MIN_BLOCKS


def _forward(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config):
  softplus_a = jax.nn.softplus(a_param.astype(jnp.float32))
  streams = (x, gate_x_logits, gate_a_logits)
  B, _, D = x.shape
  if (MOSAIC_FORWARD and config.backend == "gpu" and config.gpu_forward == "mosaic"
      and mosaic_forward_has_blocks(B, D)
      and gpu_mosaic.supports(*streams, token_rows=(reset,), block_d=MOSAIC_BLOCK_D)):
    (y,), (h_last,) = gpu_mosaic.mosaic_scan(
        _forward_step, streams, (h0,), out_dtypes=(x.dtype,), token_rows=(reset,),
        params=(softplus_a,), rows=MOSAIC_ROWS, block_d=MOSAIC_BLOCK_D, stages=MOSAIC_STAGES,
        row_unroll=MOSAIC_ROW_UNROLL, interpret=config.interpret)
  else:
    (y,), (h_last,) = blocked.blocked_scan(
        _forward_step, streams, (h0,), out_dtypes=(x.dtype,), reverse=False, config=config,
        rows=(reset,), params=(softplus_a,))
  return (y, h_last), (x, gate_x_logits, gate_a_logits, a_param, reset, h0, y)


def _backward(config, residuals, cotangents):
  x, gate_x_logits, gate_a_logits, a_param, reset, h0, y = residuals
  dy, dh_last = cotangents
  a_param32 = a_param.astype(jnp.float32)
  (dx, dx_logits, da_logits), (dh0, d_softplus) = blocked.blocked_scan(
      _backward_step, (dy, x, gate_x_logits, gate_a_logits),
      (dh_last.astype(jnp.float32), jnp.zeros_like(h0, jnp.float32)),
      out_dtypes=(x.dtype, gate_x_logits.dtype, gate_a_logits.dtype), reverse=True,
      config=config, lookahead=(y, h0), rows=(reset,), params=(jax.nn.softplus(a_param32),))
  d_a_param = jnp.sum(d_softplus, axis=0) * jax.nn.sigmoid(a_param32)
  return (dx, dx_logits, da_logits, d_a_param.astype(a_param.dtype), jnp.zeros_like(reset),
          dh0.astype(h0.dtype))


rg_lru_with_config.defvjp(_forward, _backward)


# The time-chunked schedule (``rg_lru_chunked``): rows of at least this many steps per chunk,
# no chunks where the batch alone gives UNCHUNKED_MIN_PROGRAMS programs of 128 channels, and
# otherwise chunks until the runs give CHUNKED_BLOCKS Mosaic forward blocks (time_chunks).
MIN_CHUNK_T = 256
UNCHUNKED_MIN_PROGRAMS = 128
CHUNKED_BLOCKS = 256


def _end_step(carries, ins):
  # A chunk from a zero state: its end state and the product of its decays, nothing written.
  (h, p), (x, x_logit, a_logit, reset, softplus_a) = carries, ins
  gate_x, _, a, _, mult, _ = _gates(x_logit, a_logit, reset, softplus_a)
  return (a * h + x * gate_x * mult, p * a), ()


def _carry_step(carries, ins):
  # A chunk's own dy carried back to its start from a zero cotangent at its end (the decay
  # alone: ``c = a_t (dy_t + c)``), nothing written.
  (c,), (dy, a_logit, reset, softplus_a) = carries, ins
  a = _gates(a_logit, a_logit, reset, softplus_a)[2]  # (its input gate unused: no x_logit read)
  return (a * (dy + c),), ()


def time_chunks(batch: int, length: int, width: int) -> int:
  """Chunks of the time axis for ``rg_lru_chunked``: 1 (the plain kernels) where the batch
  alone gives the Triton kernels ``UNCHUNKED_MIN_PROGRAMS`` programs of 128 channels; else
  doubled (while they divide ``length`` into runs of at least ``MIN_CHUNK_T``) until
  ``batch x chunks`` rows fill ``CHUNKED_BLOCKS`` blocks of ``MOSAIC_BLOCK_D`` channels.

  The chunks rescue batches too small for the kernels' blocks (Griffin 400M at 4 rows of 8192:
  179.1 -> 172.4 ms a step on an H100, session 19). Where the batch already gives about one
  program per SM they cost more than they save: Griffin 1.3B in micro-batches of 8 rows of 2048
  (D = 2560, 160 programs of 128 channels) took 1074.3 ms a step with 2 chunks (the Mosaic
  forward, 256-channel backward blocks, the chunks' two extra passes) and 1061.8 ms without
  (then the Triton forward; the Mosaic forward since session 27), and compiled in 61.5 s
  against 109.9 (session 23, one H100, same call)."""
  if _blocks(batch, width) >= UNCHUNKED_MIN_PROGRAMS:
    return 1
  chunks = 1
  while (_blocks(batch * chunks, width) < CHUNKED_BLOCKS
         and length % (2 * chunks) == 0 and length // (2 * chunks) >= MIN_CHUNK_T):
    chunks *= 2
  return chunks


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def rg_lru_chunked(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config, chunks):
  """``rg_lru_with_config`` with the time axis cut into ``chunks`` runs scanned side by side.

  A few long rows (4 x 8192 at Griffin-400M's width) leave the sequential kernels too few
  programs: the forward falls back from the Mosaic kernel to a Triton one at 64-channel blocks
  and the layer took 2.42 ms forward + backward on an H100, 1.16 ms in 4 runs (session 19,
  docs/kernels.md). The recurrence is affine in the state a run starts from,
  ``h_end = P h_start + e`` (``P`` the run's product of decays, ``e`` its end state from zero),
  so ``[B, T, D]`` is read as ``[B * chunks, T / chunks, D]`` (a free reshape) and:

  - forward: one pass (``_end_step``) gives every run's ``P`` and ``e`` without writing
    anything; a ``[B, chunks, D]`` composition in order gives each run's start; the fused
    forward then runs on all runs at once from those starts;
  - backward: one reverse pass (``_carry_step``, reading only ``dy`` and the decay's logits)
    gives the cotangent each run's own ``dy`` sends into its start; the reverse composition gives
    each run's ``dh_last``; the fused backward then runs on all runs at once, reading each run's
    ``h_start`` at its boundary.

  The gradients are those of the one long scan (the runs only reorder the same sums). Arguments
  as ``rg_lru_with_config``; ``T`` divisible by ``chunks``.
  """
  return _chunked_forward(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config,
                          chunks)[0]


def _runs(chunks, *arrays):
  return tuple(a.reshape(a.shape[0] * chunks, a.shape[1] // chunks, *a.shape[2:])
               for a in arrays)


def _chunked_forward(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config, chunks):
  B, T, D = x.shape
  softplus_a = jax.nn.softplus(a_param.astype(jnp.float32))
  xs, gxs, gas, resets = _runs(chunks, x, gate_x_logits, gate_a_logits, reset)
  zeros = jnp.zeros((B * chunks, D), jnp.float32)
  _, (ends, decays) = blocked.blocked_scan(
      _end_step, (xs, gxs, gas), (zeros, zeros + 1.0), out_dtypes=(), reverse=False,
      config=config, rows=(resets,), params=(softplus_a,))
  ends, decays = ends.reshape(B, chunks, D), decays.reshape(B, chunks, D)
  starts, h = [], h0
  for k in range(chunks):
    starts.append(h)
    h = decays[:, k] * h + ends[:, k]
  starts = jnp.stack(starts, axis=1).reshape(B * chunks, D)
  (y, h_lasts), _ = _forward(xs, gxs, gas, a_param, resets, starts, config)
  h_last = h_lasts.reshape(B, chunks, D)[:, -1]
  residuals = (x, gate_x_logits, gate_a_logits, a_param, reset, starts, decays, y)
  return (y.reshape(B, T, D), h_last), residuals


def _chunked_backward(config, chunks, residuals, cotangents):
  x, gate_x_logits, gate_a_logits, a_param, reset, starts, decays, y = residuals
  dy, dh_last = cotangents
  B, T, D = x.shape
  softplus_a = jax.nn.softplus(a_param.astype(jnp.float32))
  xs, gxs, gas, resets, dys = _runs(chunks, x, gate_x_logits, gate_a_logits, reset,
                                    dy.astype(x.dtype))
  _, (carried,) = blocked.blocked_scan(
      _carry_step, (dys, gas), (jnp.zeros((B * chunks, D), jnp.float32),), out_dtypes=(),
      reverse=True, config=config, rows=(resets,), params=(softplus_a,))
  carried = carried.reshape(B, chunks, D)
  run_dh_last, d = [None] * chunks, dh_last.astype(jnp.float32)
  for k in reversed(range(chunks)):
    run_dh_last[k] = d
    d = decays[:, k] * d + carried[:, k]
  dx, dgx, dga, d_a_param, _, dh0s = _backward(
      config, (xs, gxs, gas, a_param, resets, starts, y),
      (dys, jnp.stack(run_dh_last, axis=1).reshape(B * chunks, D)))
  back = lambda a: a.reshape(B, T, D)
  return (back(dx), back(dgx), back(dga), d_a_param, jnp.zeros_like(reset),
          dh0s.reshape(B, chunks, D)[:, 0])


rg_lru_chunked.defvjp(_chunked_forward, _chunked_backward)


def gpu_block(batch: int, width: int) -> dict:
  """The fused Triton kernels' block shape on GPU: one channel per thread (``block_d / 32``
  warps), blocks narrow enough for about 128 programs (one per SM) when the batch is small, and
  chunks of 16 rows in flight at 256 channels (measured there).

  The gate arithmetic sits in the sequential loop, so these kernels are bound by instruction
  latency more than the plain scan. On an H100 at the Griffin-400M shape (B=16, T=2048, D=2048,
  fwd+bwd): 256 channels on 8 warps 1.054 ms, on 4 warps (the scan's shape) 1.415 ms, the XLA
  gating plus the Pallas scan 1.627 ms; 16-row chunks in the backward (5 streams, 8 rows by the
  scan's rule) 0.847 against 0.913 ms. With 4 rows of 8192 the scan's shape left 32 programs
  and the fused layer made the whole training step slower than the unfused one (220.9 vs
  about 200 ms).
  """
  block = 256
  while block > 64 and batch * -(-width // block) < 128:
    block //= 2
  return dict(gpu_block_d=block, gpu_num_warps=block // 32, gpu_chunk=16 if block == 256 else None)


def rg_lru(x, gate_x_logits, gate_a_logits, a_param, reset=None, h0=None, *, interpret=False):
  """The fused RG-LRU layer (gates, decay, normalisation and the scan in one kernel).

  Args:
    x, gate_x_logits, gate_a_logits: ``[B, T, D]`` (float32 or bfloat16).
    a_param: ``[D]``, the decay parameter: ``log a_t = -8 * gate_a_t * softplus(a_param)``.
    reset: bool ``[B, T]``, True at the first token of a document (the state restarts there),
      or None.
    h0: ``[B, D]`` float32 or None (zeros).
    interpret: run the TPU kernel in TPU interpret mode (also chosen on a CPU target).

  Returns:
    ``y: [B, T, D]`` in ``x``'s dtype and ``h_last: [B, D]`` float32. Differentiable in ``x``,
    both gate logits, ``a_param`` and ``h0``.
  """
  B, T, D = x.shape
  if gate_x_logits.shape != x.shape or gate_a_logits.shape != x.shape or a_param.shape != (D,):
    raise ValueError(f"shapes: x {x.shape}, gate logits {gate_x_logits.shape} "
                     f"{gate_a_logits.shape}, a_param {a_param.shape}")
  reset = (jnp.zeros((B, T), jnp.float32) if reset is None
           else jax.lax.stop_gradient(reset.astype(jnp.float32)))
  h0 = jnp.zeros((B, D), jnp.float32) if h0 is None else h0.astype(jnp.float32)
  config = dispatch.scan_config(interpret)
  if config.backend == "gpu":
    chunks = time_chunks(B, T, D)
    config = dataclasses.replace(config, **gpu_block(B * chunks, D))
    if chunks > 1:
      return rg_lru_chunked(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config, chunks)
  return rg_lru_with_config(x, gate_x_logits, gate_a_logits, a_param, reset, h0, config)
