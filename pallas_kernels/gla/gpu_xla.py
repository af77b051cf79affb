"""The GPU path of chunk_gla: batched matrix products in XLA, the chunk recurrence as a scan.

Every chunk of C tokens (per batch row and head) is independent once the state S_n at its
start is known, and S_n follows a short elementwise recurrence over the NT = T / C chunks:

    S_{n+1} = a_n S_n + U_n,    a_n = exp(b_C) (per K row),    U_n = (k exp(b_C - b))^T v

(b the chunk-local inclusive cumulative sum of log_g, float32). So the forward is: b by a
cumulative sum; U for all chunks by one batched product; the recurrence by the Pallas
linear-scan kernel over [B H, NT, K V] (`pallas_kernels.linear_scan`'s GPU kernel, already
tuned for memory bandwidth); then every chunk's output by batched products,

    o = (scale q exp(b)) S_n + A v,    A_tu = scale sum_k q_tk k_uk exp(b_tk - b_uk), u <= t.

A uses secondary chunking for stability (as in chunk_math): query sub-chunk i (16 rows) meets
earlier keys by one product after rescaling both sides to the cumulative log-gate just before
the sub-chunk (both exponents <= 0); the 16 x 16 diagonal blocks are a float32 reduction over K
in log space, which XLA fuses into one kernel without materialising the [16, 16, K] terms.
Every exponent is a later minus an earlier cumulative log-gate, clamped at 0 where a masked
pair would make it positive: gates down to e^-20 per step stay finite.

The backward runs the same recurrence reversed for the gradient of the chunk states,

    dH_n = a_n dH_{n+1} + (scale q exp(b))^T do,   dH_NT = d h_last,

keeps the chunk-start states and A from the forward, and forms dq, dk, dv with the same
products (key-side off-diagonal blocks rescaled to the end of the key sub-chunk). d log_g is
the reverse cumulative sum of q dq - k dk (see chunk_gla._log_gate_grad).

Resets are masks as everywhere else (gla.reference.chunk_reset_counts): a query sees the
entering state only with count 0, pairs attend only with equal counts, keys reach the chunk
end only with the chunk's last count, and a chunk with a document start passes no state on.

Layout: the token arrays are transposed once to [B, H, NT, C, X] (contiguous C x X tiles per
chunk); any K and V (no padding).

This module is chunk_gla's GPU path for shapes gla.gpu does not take (K or V not a power of
two >= 16, float32 on a GPU, tiles beyond the shared memory) and with GLA_GPU_IMPL=xla.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.rg_lru import blocked
from pallas_kernels.rg_lru import scan as scan_linear
from pallas_kernels.gla.reference import add_later_chunks

SUB = 16
F32 = jnp.float32


def _prec(dt):
  return lax.Precision.HIGHEST if dt == F32 else lax.Precision.DEFAULT


def _mm(spec, a, b, dt):
  """einsum with both operands in dt (float32 accumulation; exact float32 for float32)."""
  return jnp.einsum(spec, a.astype(dt), b.astype(dt), precision=_prec(jnp.dtype(dt)),
                    preferred_element_type=F32)


def _exp_le0(x):
  return jnp.exp(jnp.minimum(x, 0.0))


def _split(x):
  """[..., C, X] -> [..., C / SUB, SUB, X]."""
  return x.reshape(*x.shape[:-2], x.shape[-2] // SUB, SUB, x.shape[-1])


def _before_sub(b):
  """[..., n, 1, K]: the cumulative log-gate just before each sub-chunk (0 before the first)."""
  c = b.shape[-2]
  prev = b[..., SUB - 1:c - 1:SUB, :]
  return jnp.concatenate([jnp.zeros_like(b[..., :1, :]), prev], axis=-2)[..., :, None, :]


def _sub_blocks(c):
  """(query sub-chunk i [n, 1, 1], key sub-chunk of column u [1, 1, C]) index grids."""
  n = c // SUB
  i = lax.broadcasted_iota(jnp.int32, (n, 1, 1), 0)
  u = lax.broadcasted_iota(jnp.int32, (1, 1, c), 2) // SUB
  return i, u


def _diag_terms(bsub):
  """exp(b_t - b_u) for t, u in one sub-chunk: [..., n, SUB t, SUB u, K], clamped at 0."""
  return _exp_le0(bsub[..., :, None, :] - bsub[..., None, :, :])


def _attention(qs, k, b, keep, dt):
  """A [..., C, C] float32 (scale included in qs), zero outside `keep`."""
  c = qs.shape[-2]
  n = c // SUB
  ref = _before_sub(b)
  qsub, ksub, bsub = _split(qs), _split(k), _split(b)
  q_ref = qsub * _exp_le0(bsub - ref)                             # [..., n, SUB, K]
  k_ref = k[..., None, :, :] * _exp_le0(ref - b[..., None, :, :])  # [..., n, C, K]
  off = _mm("...itk,...iuk->...itu", q_ref, k_ref, dt)            # [..., n, SUB, C]
  diag = jnp.sum(qsub[..., :, None, :] * ksub[..., None, :, :] * _diag_terms(bsub), axis=-1)
  diag = jnp.concatenate([diag] * n, axis=-1)                      # [..., n, SUB, C]
  i, u = _sub_blocks(c)
  a = jnp.where(u < i, off, jnp.where(u == i, diag, 0.0))
  return jnp.where(keep, a.reshape(*a.shape[:-3], c, c), 0.0)


def _attention_grads(dattn, qs, k, b, dt):
  """(dqs, dk) [..., C, K] float32 through A, from dattn = dL/dA [..., C, C] (zero off keep)."""
  c, kd = qs.shape[-2:]
  n = c // SUB
  i, u = _sub_blocks(c)
  ref = _before_sub(b)
  qsub, ksub, bsub = _split(qs), _split(k), _split(b)
  da = dattn.reshape(*dattn.shape[:-2], n, SUB, c)
  # Diagonal blocks, float32 log space.
  da_diag = jnp.stack([da[..., j, :, j * SUB:(j + 1) * SUB] for j in range(n)], axis=-3)
  # Every reduction over the last axis: XLA's row-reduction kernels. Written as sums over a
  # middle axis (key or query rows, K last) the same two reductions made the whole forward +
  # backward 2.8x slower on an H100 whenever B > 1 (9.26 against 3.30 ms at (2, 8192, 16, 64);
  # at B = 1 both forms took 3.2 ms).
  tr = lambda x: jnp.swapaxes(x, -1, -2)
  kt, qt, bt = tr(ksub), tr(qsub), tr(bsub)                       # [..., n, K, SUB]
  dq = jnp.sum(da_diag[..., :, None, :] * kt[..., None, :, :]
               * _exp_le0(bsub[..., :, :, None] - bt[..., None, :, :]), axis=-1)
  dk = jnp.sum(tr(da_diag)[..., :, None, :] * qt[..., None, :, :]
               * _exp_le0(bt[..., None, :, :] - bsub[..., :, :, None]), axis=-1)
  if n > 1:
    # Queries of sub-chunk i against earlier keys, rescaled to just before sub-chunk i.
    k_ref = k[..., None, :, :] * _exp_le0(ref - b[..., None, :, :])
    da_off = jnp.where(u < i, da, 0.0)
    dq += _exp_le0(bsub - ref) * _mm("...itu,...iuk->...itk", da_off, k_ref, dt)
    # Keys of sub-chunk j against later queries, rescaled to the end of sub-chunk j.
    end = bsub[..., :, SUB - 1:, :]                                   # [..., n, 1, K]
    q_late = qs[..., None, :, :] * _exp_le0(b[..., None, :, :] - end)  # [..., n, C, K]
    da_t = jnp.swapaxes(dattn.reshape(*dattn.shape[:-1], n, SUB), -3, -2)  # [..., j, C t, SUB u]
    t_blk = lax.broadcasted_iota(jnp.int32, (1, c, 1), 1) // SUB
    j_blk = lax.broadcasted_iota(jnp.int32, (n, 1, 1), 0)
    da_t = jnp.where(t_blk > j_blk, da_t, 0.0)
    dk += _exp_le0(end - bsub) * _mm("...jtu,...jtk->...juk", da_t, q_late, dt)
  return dq.reshape(*dq.shape[:-3], c, kd), dk.reshape(*dk.shape[:-3], c, kd)


def _chunk_scan(x, a, h0, reverse, interpret):
  """h_n = a_n h_{n-1} + x_n over axis 1 of [Z, NT, D] float32 -> (h per step, h_last), by
  the Pallas linear-scan kernel (its GPU variant)."""
  config = blocked.ScanConfig(backend="gpu", interpret=interpret)
  return scan_linear.linear_scan_with_config(x, a, h0, reverse, config)


class _Chunks:
  """Per-chunk views and masks shared by the forward and the backward."""

  def __init__(self, q, k, g, rc, scale, c):
    bsz, tp, h, kd = q.shape
    self.shape = (bsz, h, tp // c, c)
    self.c = c
    self.b = jnp.cumsum(self.tiles(g).astype(F32), axis=-2)       # [B, H, NT, C, K]
    self.total = self.b[..., -1:, :]                              # [B, H, NT, 1, K]
    self.decay = jnp.exp(self.total)
    self.q_in = jnp.exp(self.b)                                   # multiplies scale q
    self.k_out = jnp.exp(self.total - self.b)                     # multiplies k (<= 1)
    causal = jnp.tril(jnp.ones((c, c), bool))
    if rc is None:
      self.keep = causal
    else:
      rows = rc.reshape(bsz, 1, tp // c, c, 1)
      last = rows[..., -1:, :]
      self.q_in = jnp.where(rows == 0, self.q_in, 0.0)
      self.k_out = jnp.where(rows == last, self.k_out, 0.0)
      self.decay = jnp.where(last == 0, self.decay, 0.0)
      self.keep = causal & (rows == jnp.swapaxes(rows, -1, -2))
    self.qs = self.tiles(q).astype(F32) * scale
    self.k = self.tiles(k)

  def tiles(self, x):
    """[B, Tp, H, X] -> [B, H, NT, C, X]."""
    bsz, h, nt, c = self.shape
    return x.reshape(bsz, nt, c, h, x.shape[-1]).transpose(0, 3, 1, 2, 4)

  def untile(self, x):
    bsz, h, nt, c = self.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(bsz, nt * c, h, x.shape[-1])

  def scan_states(self, x, init, reverse, interpret):
    """The chunk recurrence on [B, H, NT, K, V] float32 -> (per-chunk results, last)."""
    bsz, h, nt, _ = self.shape
    kd, vd = x.shape[-2:]
    a = jnp.broadcast_to(jnp.swapaxes(self.decay, -1, -2), x.shape)
    flat = lambda y: y.reshape(bsz * h, nt, kd * vd)
    ys, last = _chunk_scan(flat(x), flat(a), init.reshape(bsz * h, kd * vd), reverse, interpret)
    return ys.reshape(x.shape), last.reshape(init.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def gla(scale, c, interpret, q, k, v, g, s0, rc):
  """o [B, Tp, H, V] (q's dtype), h_last [B, H, K, V] float32; Tp a multiple of c.

  q, k, g: [B, Tp, H, K]; v: [B, Tp, H, V]; s0 [B, H, K, V] float32; rc [B, Tp] float32 reset
  counts (gla.reference.chunk_reset_counts) or None.
  """
  return _fwd(scale, c, interpret, q, k, v, g, s0, rc)[0]


def _fwd(scale, c, interpret, q, k, v, g, s0, rc):
  dt = q.dtype
  ch = _Chunks(q, k, g, rc, scale, c)
  vt = ch.tiles(v)
  u = _mm("...ck,...cv->...kv", ch.k.astype(F32) * ch.k_out, vt, dt)   # [B, H, NT, K, V]
  ends, s_last = ch.scan_states(u, s0, False, interpret)
  starts = jnp.concatenate([s0[:, :, None], ends[:, :, :-1]], axis=2)
  attn = _attention(ch.qs, ch.k.astype(F32), ch.b, ch.keep, dt).astype(dt)
  o = _mm("...ck,...kv->...cv", ch.qs * ch.q_in, starts, dt) + _mm("...tu,...uv->...tv",
                                                                   attn, vt, dt)
  o = ch.untile(o.astype(dt))
  return (o, s_last), (q, k, v, g, s0, rc, starts, attn, s_last)


def _bwd(scale, c, interpret, res, cts):
  q, k, v, g, s0, rc, starts, attn, s_last = res
  do, ds_last = cts
  dt = q.dtype
  ch = _Chunks(q, k, g, rc, scale, c)
  vt, dot = ch.tiles(v), ch.tiles(do)
  q_in = ch.qs * ch.q_in
  w = _mm("...ck,...cv->...kv", q_in, dot, dt)
  d_starts, ds0 = ch.scan_states(w, ds_last.astype(F32), True, interpret)
  d_ends = jnp.concatenate([d_starts[:, :, 1:], ds_last[:, :, None].astype(F32)], axis=2)
  dattn = jnp.where(ch.keep, _mm("...tv,...uv->...tu", dot, vt, dt), 0.0)
  kf = ch.k.astype(F32)
  dqs, dk = _attention_grads(dattn, ch.qs, kf, ch.b, dt)
  dqs += ch.q_in * _mm("...cv,...kv->...ck", dot, starts, dt)
  dk += ch.k_out * _mm("...cv,...kv->...ck", vt, d_ends, dt)
  dv = (_mm("...ck,...kv->...cv", kf * ch.k_out, d_ends, dt)
        + _mm("...tu,...tv->...uv", attn, dot, dt))
  dq = dqs * scale
  dgl = ch.qs / scale * dq - kf * dk                               # dL/dG, [B, H, NT, C, K]
  dlog_g = _reverse_cumsum(dgl) + jnp.sum(ds_last * s_last, axis=-1)[:, :, None, None, :]
  out = lambda x, like: ch.untile(x).astype(like.dtype)
  return (out(dq, q), out(dk, k), out(dv, v), out(dlog_g, g), ds0.astype(s0.dtype), None)


def _reverse_cumsum(x):
  """Reverse cumulative sum over the whole sequence of [B, H, NT, C, K] (chunks, then across)."""
  return add_later_chunks(jnp.flip(jnp.cumsum(jnp.flip(x, -2), axis=-2), -2), 2)


gla.defvjp(_fwd, _bwd)
