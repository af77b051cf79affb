"""Triton (Pallas) kernels for the per-chunk part of gla_gpu (opt-in: gla_gpu.INTRA).

One program per (batch row, head, chunk) of C tokens (a power of two >= 16; SUB = 16-row
sub-chunks). `forward`: from the chunk's q, k, v tiles (read in the caller's [B, T, H, X]
layout, strided), its chunk-local cumulative log-gate b (float32, [B, H, NT, C, K]) and its
entering state S_n (float32, from the scan's per-chunk output) it writes

    o = (scale q exp(b)) S_n + A v          (straight into [B, T, H, V]: no transpose after)
    A_tu = scale sum_k q_tk k_uk exp(b_tk - b_uk),  u <= t  (in q's dtype, [B, H, NT, C, C]:
                                                            the backward keeps it)

with the same arithmetic as gla_gpu._attention (secondary chunking):

- off-diagonal 16 x 16 blocks (query sub-chunk i, key sub-chunk j < i) by one tensor-core dot
  each, after rescaling both sides to the cumulative gate just before sub-chunk i, `ref_i`:
  the query side by exp(b_t - ref_i), the key side by exp(ref_i - b_u), both exponents <= 0
  (clamped at 0), operands in the input dtype, float32 accumulation;
- diagonal 16 x 16 blocks in float32 log space, one key row u at a time: column u of the block
  is sum_k (q_i * k_u * exp(min(b_i - b_u, 0)))[:, k] over a [16, K] tile (never a
  [16, 16, K] tensor in registers), placed by a select (DIAG = "kpieces": 16-column pieces
  of K with [16, 16, 16] terms instead);
- A v and the inter-chunk term by dots of [16, 16] x [16, V] and [16, K] x [K, V].

`backward` is the same per chunk for dq, dk, dv (see its docstring). Sub-chunks are walked by
fori_loops, not unrolled in Python: unrolled, ptxas spilled 9 KB per thread in the backward
(scripts/ptxas_gla_intra.py measures registers and spills without a GPU).

Every exponent is a later minus an earlier cumulative log-gate, clamped at 0 where a masked pair
would make it positive: gates of e^-20 per step give no inf or NaN.

Resets (packed documents) are supported with the same masks as gla_gpu (reset counts `rc`: a
query sees the entering state only with count 0, pairs attend only with equal counts).

Triton constraints: every block dimension must be a power of two and dot operands at least 16
wide, so K and V are zero-padded here to max(16, next power of two) when they are not already
(the zero columns contribute nothing; o is sliced back). Dh = 64 or 128 needs no padding.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SUB = 16
F32 = jnp.float32

# Warps per program of both kernels; None: 4, or 8 when K or V > 64 (not tuned: no GPU yet).
NUM_WARPS = None
# The forward's diagonal blocks: "rows" (a loop over the 16 key rows, [16, K] tiles) or
# "kpieces" (a loop over 16-column pieces of K, [16, 16, 16] tiles). Neither measured yet.
DIAG = "rows"


def _warps(width):
  return NUM_WARPS or (4 if width <= 64 else 8)


def _pow2(n):
  return max(16, 1 << (n - 1).bit_length())


def _dot(a, b, contract, dtype):
  """a . b contracting a's axis contract[0] with b's contract[1]; operands in dtype, f32 acc."""
  prec = lax.Precision.HIGHEST if dtype == F32 else lax.Precision.DEFAULT
  return lax.dot_general(a.astype(dtype), b.astype(dtype),
                         (((contract[0],), (contract[1],)), ((), ())),
                         precision=prec, preferred_element_type=F32)


def _exp_le0(x):
  return jnp.exp(jnp.minimum(x, 0.0))


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _neighbour(per_chunk_ref, edge_ref, at_edge):
  """A chunk's state from the neighbouring chunk's entry of per_chunk_ref, or edge_ref at the
  edge chunk (see _neighbour_specs): the entering state from (ends, s0), the gradient of the
  leaving state from (d_starts, dh_last), without concatenating a shifted copy in XLA.
  (at_edge: pl.program_id compared outside any loop: interpret mode needs it there.)"""
  return lax.cond(at_edge, lambda: edge_ref[...], lambda: per_chunk_ref[...])


def _neighbour_specs(per_chunk, edge, shift):
  """Block specs of [B, H, NT, K, V] at chunk n + shift (clipped) and of the [B, H, K, V] edge."""
  nt = per_chunk.shape[2]
  kd, vd = per_chunk.shape[-2:]
  at = lambda n: jnp.minimum(jnp.maximum(n + shift, 0), nt - 1)
  return [pl.BlockSpec((None, None, None, kd, vd), lambda b, h, n: (b, h, at(n), 0, 0)),
          pl.BlockSpec((None, None, kd, vd), lambda b, h, n: (b, h, 0, 0))]


def _pad_last2(x, kp, vp):
  pad = ((0, 0),) * (x.ndim - 2) + ((0, kp - x.shape[-2]), (0, vp - x.shape[-1]))
  return jnp.pad(x, pad) if any(p[1] for p in pad) else x


def _forward_kernel(*refs, scale, c, has_resets):
  if has_resets:
    q_ref, k_ref, v_ref, b_ref, ends_ref, s0_ref, rc_ref, rr_ref, o_ref, a_ref = refs
  else:
    q_ref, k_ref, v_ref, b_ref, ends_ref, s0_ref, o_ref, a_ref = refs
    rc_ref = rr_ref = None
  dt = q_ref.dtype
  n = c // SUB
  causal = _iota((SUB, SUB), 1) <= _iota((SUB, SUB), 0)
  cols = _iota((SUB, SUB), 1)
  first = pl.program_id(2) == 0
  state = _neighbour(ends_ref, s0_ref, first).astype(dt)

  # Loops (not Python unrolling) over sub-chunks bound the live ranges: ptxas then keeps the
  # kernel in registers (see docs/kernels.md).
  def query_sub_chunk(i, carry):
    r0 = pl.multiple_of(i * SUB, SUB)
    rows_i = pl.ds(r0, SUB)
    qi = q_ref[rows_i, :].astype(F32) * scale                    # [16, K]
    bi = b_ref[rows_i, :]                                         # [16, K]
    rc_i = None if rc_ref is None else rc_ref[rows_i, :]          # [16, 1]
    # Inter-chunk term: (scale q exp(b)) S_n, only for queries that see the entering state.
    q_in = qi * jnp.exp(bi)
    if rc_i is not None:
      q_in = jnp.where(rc_i == 0.0, q_in, 0.0)
    acc = _dot(q_in, state, (1, 0), dt)  # [16, V]
    # Off-diagonal blocks: both sides rescaled to ref_i, the cumulative gate before row 16 i
    # (for i = 0 there are none; row 0 stands in).
    ref_i = b_ref[pl.ds(jnp.maximum(r0 - 1, 0), 1), :]            # [1, K]
    q_rs = qi * _exp_le0(bi - ref_i)

    def key_sub_chunk(j, acc):
      rows_j = pl.ds(pl.multiple_of(j * SUB, SUB), SUB)
      k_rs = k_ref[rows_j, :].astype(F32) * _exp_le0(ref_i - b_ref[rows_j, :])
      a_ij = _dot(q_rs, k_rs, (1, 1), dt)                         # [16, 16]
      if rc_i is not None:
        a_ij = jnp.where(rc_i == rr_ref[:, rows_j], a_ij, 0.0)
      a_ij = a_ij.astype(dt)
      a_ref[rows_i, rows_j] = a_ij
      return acc + _dot(a_ij, v_ref[rows_j, :], (1, 0), dt)

    acc = lax.fori_loop(0, i, key_sub_chunk, acc)

    # Diagonal block, float32 log space, one key row at a time.
    def key_row(u, a_ii):
      row = pl.ds(r0 + u, 1)
      k_u = k_ref[row, :].astype(F32)                             # [1, K]
      b_u = b_ref[row, :]
      col = jnp.sum(qi * k_u * _exp_le0(bi - b_u), axis=1, keepdims=True)  # [16, 1]
      return a_ii + jnp.where(cols == u, col, 0.0)

    # Or in K pieces of 16 columns: [16, 16, 16] terms per piece, 4 pieces at K = 64 (more
    # work per step, fewer dependent steps).
    def k_piece(p, a_ii):
      piece = pl.ds(pl.multiple_of(p * SUB, SUB), SUB)
      qp = q_ref[rows_i, piece].astype(F32) * scale               # [16 t, 16 k]
      kp_ = k_ref[rows_i, piece].astype(F32)                      # [16 u, 16 k]
      bp = b_ref[rows_i, piece]
      terms = qp[:, None, :] * kp_[None, :, :] * _exp_le0(bp[:, None, :] - bp[None, :, :])
      return a_ii + jnp.sum(terms, axis=2)

    if DIAG == "kpieces":
      a_ii = lax.fori_loop(0, q_ref.shape[-1] // SUB, k_piece, jnp.zeros((SUB, SUB), F32))
    else:
      a_ii = lax.fori_loop(0, SUB, key_row, jnp.zeros((SUB, SUB), F32))
    keep = causal
    if rc_i is not None:
      keep = keep & (rc_i == rr_ref[:, rows_i])
    a_ii = jnp.where(keep, a_ii, 0.0).astype(dt)
    a_ref[rows_i, rows_i] = a_ii
    acc += _dot(a_ii, v_ref[rows_i, :], (1, 0), dt)
    o_ref[rows_i, :] = acc.astype(o_ref.dtype)

    def zero_block(j, carry):
      a_ref[rows_i, pl.ds(pl.multiple_of(j * SUB, SUB), SUB)] = jnp.zeros((SUB, SUB),
                                                                          a_ref.dtype)
      return carry

    return lax.fori_loop(i + 1, n, zero_block, carry)

  lax.fori_loop(0, n, query_sub_chunk, 0)


def forward(q, k, v, b, ends, s0, rc, *, scale, chunk, interpret=False):
  """(o [B, Tp, H, V] in q's dtype, A [B, H, NT, C, C] in q's dtype).

  q, k: [B, Tp, H, K], v: [B, Tp, H, V] (q's dtype); b: [B, H, NT, C, K] float32 chunk-local
  inclusive cumulative log-gate; ends: [B, H, NT, K, V] float32 state at each chunk end and
  s0 [B, H, K, V] float32 the initial one (chunk n starts from ends[n - 1], chunk 0 from s0);
  rc: [B, Tp] float32 reset counts (gla_reference.chunk_reset_counts) or None.
  """
  bsz, tp, h, kd = q.shape
  vd = v.shape[-1]
  c = chunk
  nt = tp // c
  kp, vp = _pow2(kd), _pow2(vd)
  if kp != kd:
    padk = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, kp - kd),))
    q, k, b = padk(q), padk(k), padk(b)
  if vp != vd:
    v = jnp.pad(v, ((0, 0),) * 3 + ((0, vp - vd),))
  ends, s0 = _pad_last2(ends, kp, vp), _pad_last2(s0, kp, vp)
  tile = lambda w: pl.BlockSpec((None, c, None, w), lambda bb, hh, nn: (bb, nn, hh, 0))
  chunk_block = lambda x, y: pl.BlockSpec((None, None, None, x, y),
                                          lambda bb, hh, nn: (bb, hh, nn, 0, 0))
  in_specs = [tile(kp), tile(kp), tile(vp), chunk_block(c, kp),
              *_neighbour_specs(ends, s0, -1)]
  args = [q, k, v, b, ends, s0]
  if rc is not None:
    in_specs += [pl.BlockSpec((None, c, 1), lambda bb, hh, nn: (bb, nn, 0)),
                 pl.BlockSpec((None, None, 1, c), lambda bb, hh, nn: (bb, nn, 0, 0))]
    args += [rc.reshape(bsz, tp, 1), rc.reshape(bsz, nt, 1, c)]
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, h, vp), q.dtype),
               jax.ShapeDtypeStruct((bsz, h, nt, c, c), q.dtype)]
  out_specs = [tile(vp), chunk_block(c, c)]
  kernel = functools.partial(_forward_kernel, scale=scale, c=c, has_resets=rc is not None)
  width = max(kp, vp)
  o, a = pl.pallas_call(
      kernel, grid=(bsz, h, nt), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=_warps(width), num_stages=1),
      interpret=interpret)(*args)
  return o[..., :vd], a


def _backward_kernel(*refs, scale, c, nt, has_resets):
  if has_resets:
    (q_ref, k_ref, v_ref, do_ref, b_ref, ends_ref, s0_ref, dstarts_ref, dlast_ref, a_ref,
     rc_ref, rr_ref, dq_ref, dk_ref, dv_ref, dgl_ref) = refs
  else:
    (q_ref, k_ref, v_ref, do_ref, b_ref, ends_ref, s0_ref, dstarts_ref, dlast_ref, a_ref,
     dq_ref, dk_ref, dv_ref, dgl_ref) = refs
    rc_ref = rr_ref = None
  dt = q_ref.dtype
  n = c // SUB
  rows, cols = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
  first, last = pl.program_id(2) == 0, pl.program_id(2) == nt - 1
  # Loaded once, in the input dtype (the dots' operand dtype): fewer registers than loading
  # them per sub-chunk (ptxas, docs/kernels.md).
  state = _neighbour(ends_ref, s0_ref, first).astype(dt)          # [K, V]
  d_end = _neighbour(dstarts_ref, dlast_ref, last).astype(dt)     # dL/d(state at chunk end)
  block = lambda j: pl.ds(pl.multiple_of(j * SUB, SUB), SUB)
  load = lambda ref, j: ref[block(j), :]

  def d_attn(i, j):
    """dL/dA block (query sub-chunk i, key sub-chunk j < i) = do_i v_j^T, masked."""
    da = _dot(load(do_ref, i), load(v_ref, j), (1, 1), dt)
    if rc_ref is not None:
      da = jnp.where(load(rc_ref, i) == rr_ref[:, block(j)], da, 0.0)
    return da

  # Sub-chunks last to first (the reverse cumulative sum of d log_g runs that way), in a loop
  # rather than unrolled: unrolled, ptxas spilled ~9 KB per thread (docs/kernels.md).
  def sub_chunk(it, carry):
    s = n - 1 - it
    sl = block(s)
    r0 = pl.multiple_of(s * SUB, SUB)
    k_s, b_s = load(k_ref, s).astype(F32), load(b_ref, s)
    v_s, do_s = load(v_ref, s), load(do_ref, s)
    rc_s = None if rc_ref is None else load(rc_ref, s)             # [16, 1]
    # Inter-chunk terms: through the entering state (queries) and the leaving one (keys).
    q_in = jnp.exp(b_s)
    k_out = _exp_le0(b_ref[pl.ds(c - 1, 1), :] - b_s)
    if rc_s is not None:
      q_in = jnp.where(rc_s == 0.0, q_in, 0.0)
      k_out = jnp.where(rc_s == rc_ref[pl.ds(c - 1, 1), :], k_out, 0.0)
    dqs = q_in * _dot(do_s, state, (1, 1), dt)                    # [16, K]
    dk = k_out * _dot(v_s, d_end, (1, 1), dt)                     # [16, K]
    dv = _dot(k_s * k_out, d_end, (1, 0), dt)                     # [16, V]

    # Off-diagonal blocks, with earlier keys (rescaled to just before sub-chunk s) ...
    ref_s = b_ref[pl.ds(jnp.maximum(r0 - 1, 0), 1), :]

    def earlier_keys(j, acc):
      k_rs = load(k_ref, j).astype(F32) * _exp_le0(ref_s - load(b_ref, j))
      return acc + _dot(d_attn(s, j), k_rs, (1, 0), dt)

    dqs += _exp_le0(b_s - ref_s) * lax.fori_loop(0, s, earlier_keys, jnp.zeros_like(dqs))
    # ... and with later queries (rescaled to the end of sub-chunk s).
    end_s = b_ref[pl.ds(r0 + SUB - 1, 1), :]

    def later_queries(i, acc):
      q_rs = load(q_ref, i).astype(F32) * scale * _exp_le0(load(b_ref, i) - end_s)
      return acc + _dot(d_attn(i, s), q_rs, (0, 0), dt)

    dk += _exp_le0(end_s - b_s) * lax.fori_loop(s + 1, n, later_queries, jnp.zeros_like(dk))

    # dv through A (kept from the forward, zero outside the mask).
    def through_a(i, dv):
      return dv + _dot(a_ref[block(i), sl], load(do_ref, i), (0, 0), dt)

    dv = lax.fori_loop(s, n, through_a, dv)
    dv_ref[sl, :] = dv.astype(dv_ref.dtype)

    # Diagonal block in float32 log space, one row r at a time (as key for dq, query for dk).
    keep = cols <= rows
    keep_t = rows <= cols
    if rc_s is not None:
      same = rc_s == rr_ref[:, sl]
      keep, keep_t = keep & same, keep_t & same
    da = jnp.where(keep, _dot(do_s, v_s, (1, 1), dt), 0.0)         # [t, u]
    da_t = jnp.where(keep_t, _dot(v_s, do_s, (1, 1), dt), 0.0)     # [u, t]

    def diag_dq(r, dq_acc):
      row = pl.ds(r0 + r, 1)
      da_col = jnp.sum(jnp.where(cols == r, da, 0.0), axis=1, keepdims=True)      # dA[:, r]
      return dq_acc + da_col * k_ref[row, :].astype(F32) * _exp_le0(b_s - b_ref[row, :])

    def diag_dk(r, dk_acc):
      row = pl.ds(r0 + r, 1)
      dat_col = jnp.sum(jnp.where(cols == r, da_t, 0.0), axis=1, keepdims=True)   # dA[r, :]^T
      q_r = q_ref[row, :].astype(F32) * scale
      return dk_acc + dat_col * q_r * _exp_le0(b_ref[row, :] - b_s)

    dqs = lax.fori_loop(0, SUB, diag_dq, dqs)
    dk = lax.fori_loop(0, SUB, diag_dk, dk)
    dq_ref[sl, :] = (dqs * scale).astype(dq_ref.dtype)
    dk_ref[sl, :] = dk.astype(dk_ref.dtype)
    # dL/dG = q dq - k dk (G the cumulative log-gate); its reverse cumulative sum in the chunk.
    dgl = load(q_ref, s).astype(F32) * scale * dqs - load(k_ref, s).astype(F32) * dk
    upper = (cols >= rows).astype(F32)
    dgl_ref[sl, :] = _dot(upper, dgl, (1, 0), F32) + carry
    return carry + jnp.sum(dgl, axis=0, keepdims=True)

  lax.fori_loop(0, n, sub_chunk, jnp.zeros((1, q_ref.shape[-1]), F32))


def backward(q, k, v, do, b, ends, s0, d_starts, dh_last, attn, rc, *, scale, chunk,
             interpret=False):
  """(dq, dk, dv, dgl) in the caller's [B, Tp, H, X] layout.

  dq, dk, dv in q's dtype; dgl float32 [B, Tp, H, K], the reverse cumulative sum within each
  chunk of dL/dG = q dq - k dk (gla_gpu adds the later chunks' sums and the final state's term).
  do: [B, Tp, H, V]; d_starts: [B, H, NT, K, V] float32, dL/d(state at each chunk start), and
  dh_last [B, H, K, V] float32, dL/d(final state) (chunk n ends with d_starts[n + 1], the last
  chunk with dh_last); attn: the forward's A [B, H, NT, C, C]; the rest as in `forward`.
  """
  bsz, tp, h, kd = q.shape
  vd = v.shape[-1]
  c = chunk
  nt = tp // c
  kp, vp = _pow2(kd), _pow2(vd)
  do = do.astype(q.dtype)
  if kp != kd:
    padk = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, kp - kd),))
    q, k, b = padk(q), padk(k), padk(b)
  if vp != vd:
    v, do = (jnp.pad(x, ((0, 0),) * 3 + ((0, vp - vd),)) for x in (v, do))
  ends, s0, d_starts, dh_last = (_pad_last2(x, kp, vp) for x in (ends, s0, d_starts, dh_last))
  tile = lambda w: pl.BlockSpec((None, c, None, w), lambda bb, hh, nn: (bb, nn, hh, 0))
  chunk_block = lambda x, y: pl.BlockSpec((None, None, None, x, y),
                                          lambda bb, hh, nn: (bb, hh, nn, 0, 0))
  in_specs = [tile(kp), tile(kp), tile(vp), tile(vp), chunk_block(c, kp),
              *_neighbour_specs(ends, s0, -1), *_neighbour_specs(d_starts, dh_last, 1),
              chunk_block(c, c)]
  args = [q, k, v, do, b, ends, s0, d_starts, dh_last, attn]
  if rc is not None:
    in_specs += [pl.BlockSpec((None, c, 1), lambda bb, hh, nn: (bb, nn, 0)),
                 pl.BlockSpec((None, None, 1, c), lambda bb, hh, nn: (bb, nn, 0, 0))]
    args += [rc.reshape(bsz, tp, 1), rc.reshape(bsz, nt, 1, c)]
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, h, kp), q.dtype),
               jax.ShapeDtypeStruct((bsz, tp, h, kp), q.dtype),
               jax.ShapeDtypeStruct((bsz, tp, h, vp), q.dtype),
               jax.ShapeDtypeStruct((bsz, tp, h, kp), F32)]
  out_specs = [tile(kp), tile(kp), tile(vp), tile(kp)]
  kernel = functools.partial(_backward_kernel, scale=scale, c=c, nt=nt,
                             has_resets=rc is not None)
  width = max(kp, vp)
  dq, dk, dv, dgl = pl.pallas_call(
      kernel, grid=(bsz, h, nt), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=_warps(width), num_stages=1),
      interpret=interpret)(*args)
  return dq[..., :kd], dk[..., :kd], dv[..., :vd], dgl[..., :kd]
