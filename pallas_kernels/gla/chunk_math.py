"""The per-chunk arithmetic of the GLA Mosaic kernels (gla.tpu): the bodies of their programs.

One chunk holds C rows (tokens). Within it, b = the inclusive cumulative sum of the log-gates
along the rows, so b decreases down the chunk and exp(b_t - b_u) is the decay from u to t. The
state of one head is kept transposed, sT: [V, K], so that the per-K decay of the state is a
broadcast along the lanes ([1, K]) rather than along the sublanes.

Stability rule: every exponent is "later cumulative log-gate minus earlier one" (<= 0), clamped
at 0 where a masked-out pair would make it positive, so nothing overflows even for gates of
e^-20 per step. The intra-chunk attention uses secondary chunking (sub-chunks of SUB rows): a
query sub-chunk meets earlier keys through one ordinary (bfloat16 when the inputs are)
matrix product, after rescaling both sides to a reference point between them (the boundary
of the query sub-chunk), and meets its own sub-chunk in float32 log space through a
[SUB, SUB, K] tensor.

Reset masks (packed documents) arrive as `rc` [C, 1] and `rr` [1, C], each row's count of
document starts within the chunk (see gla_reference.chunk_reset_counts); None when unused.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB = 16
F32 = jnp.float32


def _dot(a, b, contract, dtype):
  # float32 operands need HIGHEST: TPUs would otherwise round them to bfloat16 (Triton maps
  # it to IEEE float32).
  prec = lax.Precision.HIGHEST if dtype == F32 else lax.Precision.DEFAULT
  return lax.dot_general(
      a.astype(dtype), b.astype(dtype), (((contract[0],), (contract[1],)), ((), ())),
      precision=prec, preferred_element_type=F32)


def mm(a, b, dtype):  # a @ b
  return _dot(a, b, (1, 0), dtype)


def mm_t(a, b, dtype):  # a @ b.T
  return _dot(a, b, (1, 1), dtype)


def tmm(a, b, dtype):  # a.T @ b
  return _dot(a, b, (0, 0), dtype)


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def prefix_rows(g, start, rows):
  """Rows [start, start+rows) of the inclusive cumulative sum of g [C, K] down the rows.

  A 0/1 matrix product rather than cumsum: Mosaic TPU has no cumsum, and at HIGHEST precision
  the product is an exact float32 sum on both backends.
  """
  c = g.shape[0]
  tri = (_iota((rows, c), 1) <= _iota((rows, c), 0) + start).astype(F32)
  return mm(tri, g, F32)


def sum_rows_before(g, end):
  """[1, K]: the sum of the rows of g [C, K] above row `end` (the cumulative sum at end-1)."""
  return jnp.sum(jnp.where(_iota(g.shape, 0) < end, g, 0.0), axis=0, keepdims=True)


def _exp_le0(x):
  return jnp.exp(jnp.minimum(x, 0.0))


def _chunk_end(g, rr):
  """(sum of g [1, K], decay of the entering state over the chunk [1, K], last count [1, 1])."""
  total = jnp.sum(g, axis=0, keepdims=True)
  decay = jnp.exp(total)
  last = None
  if rr is not None:
    last = jnp.max(rr, axis=1, keepdims=True)  # counts never decrease down the chunk
    decay = jnp.where(last == 0, decay, 0.0)
  return total, decay, last


def state_step(s, k, v, g, rc=None, rr=None):
  """State after the chunk: s [V, K] float32 at its start; k [C, K], v [C, V], g [C, K]."""
  g = g.astype(F32)
  total, decay, last = _chunk_end(g, rr)
  k_end = k.astype(F32) * _exp_le0(total - prefix_rows(g, 0, g.shape[0]))
  if rc is not None:
    k_end = jnp.where(rc == last, k_end, 0.0)
  return decay * s + tmm(v, k_end, k.dtype)


def dstate_step(ds, q, do, g, rc=None, rr=None, *, scale):
  """Gradient w.r.t. the state at the chunk start, from ds [V, K] w.r.t. the state at its end.

  q [C, K], do [C, V] (the gradient of the chunk's output), g [C, K].
  """
  g = g.astype(F32)
  _, decay, _ = _chunk_end(g, rr)
  q_in = q.astype(F32) * scale * jnp.exp(prefix_rows(g, 0, g.shape[0]))
  if rc is not None:
    q_in = jnp.where(rc == 0, q_in, 0.0)
  return decay * ds + tmm(do, q_in, q.dtype)


def _same_doc(rc_ref, rr_ref, rows, cols, keep):
  if rc_ref is None:
    return keep
  return keep & (rc_ref[rows, :] == rr_ref[:, cols])


def output_kernel(q_ref, k_ref, v_ref, g_ref, s_ref, *refs, scale):
  """o for one chunk. q, k, g: [C, K]; v: [C, V]; s: [V, K] state at the chunk start; o [C, V]."""
  rc_ref, rr_ref, o_ref = refs if len(refs) == 3 else (None, None, refs[0])
  c = q_ref.shape[0]
  dt = q_ref.dtype
  g = g_ref[...].astype(F32)
  b = prefix_rows(g, 0, c)
  k = k_ref[...].astype(F32)
  v = v_ref[...]
  s = s_ref[...]
  all_rows = pl.ds(0, c)
  for i in range(c // SUB):
    lo = i * SUB
    rows = pl.ds(lo, SUB)
    qi = q_ref[rows, :].astype(F32) * scale
    ki = k_ref[rows, :].astype(F32)
    bi = prefix_rows(g, lo, SUB)
    q_in = qi * jnp.exp(bi)
    if rc_ref is not None:
      q_in = jnp.where(rc_ref[rows, :] == 0, q_in, 0.0)
    o = mm_t(q_in, s, dt)
    if i:
      ref = sum_rows_before(g, lo)
      scores = mm_t(qi * _exp_le0(bi - ref), k * _exp_le0(ref - b), dt)
      keep = _same_doc(rc_ref, rr_ref, rows, all_rows, _iota((SUB, c), 1) < lo)
      o += mm(jnp.where(keep, scores, 0.0), v, dt)
    decay = _exp_le0(bi[:, None, :] - bi[None, :, :])  # [query t, key u, K]
    scores = jnp.sum(qi[:, None, :] * ki[None, :, :] * decay, axis=2)
    keep = _same_doc(rc_ref, rr_ref, rows, rows, _iota((SUB, SUB), 1) <= _iota((SUB, SUB), 0))
    o += mm(jnp.where(keep, scores, 0.0), v_ref[rows, :], F32)
    o_ref[rows, :] = o.astype(o_ref.dtype)


def grads_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, s_ref, ds_ref, *refs, scale):
  """dq, dk, dv and the chunk-local reverse cumulative sum of d(cumulative log-gate).

  q, k, g: [C, K]; v, do: [C, V]; s: [V, K] state at the chunk start; ds: [V, K] gradient
  w.r.t. the state at the chunk end. Outputs dq, dk [C, K], dv [C, V], dgl [C, K] float32:
  dgl_t = sum over rows t' >= t of (q dq - k dk)_t', the gradient of the log-gates up to the
  carry from later chunks (every term of the output holds exp(G_t - G_u), G the global
  cumulative log-gate, so dL/dG_t = q_t dq_t - k_t dk_t).
  """
  if len(refs) == 6:
    rc_ref, rr_ref, dq_ref, dk_ref, dv_ref, dg_ref = refs
  else:
    (dq_ref, dk_ref, dv_ref, dg_ref), rc_ref, rr_ref = refs, None, None
  c, dk_dim = q_ref.shape
  dt = q_ref.dtype
  g = g_ref[...].astype(F32)
  b = prefix_rows(g, 0, c)
  total, _, last = _chunk_end(g, None if rr_ref is None else rr_ref[...])
  q = q_ref[...].astype(F32) * scale
  k = k_ref[...].astype(F32)
  v = v_ref[...]
  do = do_ref[...]
  s = s_ref[...]
  ds = ds_ref[...]
  all_rows = pl.ds(0, c)
  n_sub = c // SUB
  carry = jnp.zeros((1, dk_dim), F32)
  for j in reversed(range(n_sub)):
    lo, hi = j * SUB, (j + 1) * SUB
    rows = pl.ds(lo, SUB)
    qj = q_ref[rows, :].astype(F32) * scale
    kj = k_ref[rows, :].astype(F32)
    vj = v_ref[rows, :]
    doj = do_ref[rows, :]
    bj = prefix_rows(g, lo, SUB)
    # Through the states entering and leaving the chunk.
    q_in = jnp.exp(bj)
    k_out = _exp_le0(total - bj)
    if rc_ref is not None:
      q_in = jnp.where(rc_ref[rows, :] == 0, q_in, 0.0)
      k_out = jnp.where(rc_ref[rows, :] == last, k_out, 0.0)
    dq = q_in * mm(doj, s, dt)
    dk = k_out * mm(vj, ds, dt)
    dv = mm_t(kj * k_out, ds, dt)
    # Diagonal sub-block in float32 log space, laid out [key u, query t].
    decay = _exp_le0(bj[None, :, :] - bj[:, None, :])
    keep = _same_doc(rc_ref, rr_ref, rows, rows, _iota((SUB, SUB), 0) <= _iota((SUB, SUB), 1))
    scores_t = jnp.where(keep, jnp.sum(kj[:, None, :] * qj[None, :, :] * decay, axis=2), 0.0)
    dscores_t = jnp.where(keep, mm_t(vj, doj, F32), 0.0)
    dq += jnp.sum(dscores_t[:, :, None] * kj[:, None, :] * decay, axis=0)
    dk += jnp.sum(dscores_t[:, :, None] * qj[None, :, :] * decay, axis=1)
    dv += mm(scores_t, doj, F32)
    if j > 0:  # queries of this sub-chunk against earlier keys
      ref = sum_rows_before(g, lo)
      keep = _same_doc(rc_ref, rr_ref, rows, all_rows, _iota((SUB, c), 1) < lo)
      dscores = jnp.where(keep, mm_t(doj, v, dt), 0.0)
      dq += _exp_le0(bj - ref) * mm(dscores, k * _exp_le0(ref - b), dt)
    if j < n_sub - 1:  # keys of this sub-chunk against later queries
      ref = sum_rows_before(g, hi)
      keep = _same_doc(rc_ref, rr_ref, rows, all_rows, _iota((SUB, c), 1) >= hi)
      q_late = q * _exp_le0(b - ref)
      k_scale = _exp_le0(ref - bj)
      scores_t = jnp.where(keep, mm_t(kj * k_scale, q_late, dt), 0.0)
      dscores_t = jnp.where(keep, mm_t(vj, do, dt), 0.0)
      dv += mm(scores_t, do, dt)
      dk += k_scale * mm(dscores_t, q_late, dt)
    dq_ref[rows, :] = (dq * scale).astype(dq_ref.dtype)
    dk_ref[rows, :] = dk.astype(dk_ref.dtype)
    dv_ref[rows, :] = dv.astype(dv_ref.dtype)
    dgate = qj * dq - kj * dk
    later = (_iota((SUB, SUB), 0) <= _iota((SUB, SUB), 1)).astype(F32)
    dg_ref[rows, :] = mm(later, dgate, F32) + carry
    carry = carry + jnp.sum(dgate, axis=0, keepdims=True)
