"""GLA on the GPU in five Triton (Pallas) kernels, the chunk's gates factorised about its midpoint.

Per chunk of C tokens (b the chunk-local inclusive cumulative sum of log_g, float32; tot = b at
the chunk's last row, per K column; S_n the state entering chunk n):

    o   = (scale q exp(b)) S_n + A v,     A_tu = scale sum_k q_tk k_uk exp(b_tk - b_uk), u <= t
    S_n+1 = exp(tot) S_n + (k exp(tot - b))^T v

The intra-chunk attention A is one [C, K] x [K, C] tensor-core product once both sides are
rescaled about the chunk's midpoint m = tot / 2: q exp(b - m) and k exp(m - b). Every factor is
then at most exp(R / 2), R = max_k(-tot_k) the chunk's largest total decay; below LIMIT that
is safely inside float32 and bfloat16 range and the products keep the operands' relative
precision. The self terms (t = u: the largest, and in d log_g = q dq - k dk ones that cancel
exactly) are taken out of the products and added in float32. A chunk whose decay exceeds LIMIT
(gates of about e^-1 per step and stronger, at C = 64) takes an exact branch in the same kernel
(`lax.cond` per chunk): A and its gradients in float32 log space, one key row at a time, every
exponent clamped at 0. Masked (u > t) entries of the fast product may overflow; they are
removed by a select, never multiplied.

Kernels (no XLA transposes: token arrays are read and written in the caller's [B, T, H, X]
layout as strided [C, X] tiles; states are [B, H, NT, V, K], i.e. S^T):

- `_states` (forward and backward): one sequential program per (batch row, head, state tile
  [BV, BK]) walks the chunks, forward for S_n (stored before each update, in the input dtype:
  the dots' operand dtype) and in reverse for dS (the gradient of the state leaving chunk n:
  dS_n = exp(tot) dS_n+1 + (scale q exp(b))^T do).
- `_output`: one program per (chunk, block of V columns): o from S_n, q, k, v, g.
- `_grads`: two kernels, one program per (chunk, block of V columns) for dv and one per
  (chunk, block of K columns) for dq, dk and d log_g: the reverse cumulative sum of
  q dq - k dk within the chunk plus sum_v S dS for the state leaving it (which stands for the
  later chunks' sums), so d log_g needs no pass of its own.

b is recomputed from log_g in every kernel (a [C, K] cumulative sum in registers) rather than
stored. Each kernel function is its own jit, so a many-layer model lowers (and, on jaxlib >
0.10.2, Triton-compiles) it once. Resets (packed documents) use gla_gpu's masks from the
per-chunk reset counts rc: a query sees S_n only with count 0, pairs attend only with equal
counts, keys reach the chunk end only with the chunk's last count (the largest: counts only
grow within a chunk), a chunk with a document start passes no state on (`_reset_masks`).

Triton needs power-of-two blocks and dots at least 16 wide: `supported` says when this path
applies (K and V powers of two >= 16, C a power of two >= 16, and on a GPU 16-bit inputs with
K x V at most MAX_HEAD: other tiles exceed the shared memory); chunk_gla uses gla_gpu
otherwise.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32

# A chunk whose largest total log-decay over K exceeds this takes the exact float32 branch.
LIMIT = 60.0
# Square state tile per sequential program (None: by head size and grid, state_block). Set by
# measurement (docs/kernels.md).
STATE_BLOCK = None
# Programs the state kernels' grid should have at least (an H100 has 132 SMs).
MIN_PROGRAMS = 128
# The sequential kernels' loop: Triton's own software pipelining (num_stages; 3 measured best,
# docs/kernels.md) or tiles of chunk n + 1 loaded by hand before chunk n's arithmetic.
STATE_STAGES = 3
STATE_PREFETCH = False
# The per-chunk kernels' column block (V for o and dv, K for dq and dk; wider heads get more
# programs per chunk, each recomputing the chunk attention it needs) and warps per program.
# None: by kernel and head size (split, _warps).
SPLIT = None
NUM_WARPS = None


def state_block(kd: int, vd: int, pairs: int) -> tuple[int, int]:
  """The state kernels' tile (rows of V, columns of K) for `pairs` (batch row, head) pairs:
  the largest of 128 x 64, 64 x 64 and 32 x 32 (each capped at V x K) that still gives the grid
  at least MIN_PROGRAMS programs, else 32 x 32. A program reads the key (or query) and gate
  columns of its tile once per block of V rows and the value (or do) columns once per block of
  K columns, so larger tiles read less, but each program walks every chunk in turn, so fewer
  programs than SMs leave the GPU idle. H100, fwd+bwd: (8, 2048, 8, 128) 0.937 -> 0.907 ms with
  128 x 64 against 64 x 64; (8, 2048, 16, 64) 0.86 -> 0.76 with 64 x 64 against 32 x 32; GLA
  340M's (16, 2048, 4, K 128, V 256) 1.62 -> 1.49 with 128 x 64 (docs/kernels.md)."""
  if STATE_BLOCK:
    return min(vd, STATE_BLOCK), min(kd, STATE_BLOCK)
  for bv, bk in ((128, 64), (64, 64)):
    bv, bk = min(vd, bv), min(kd, bk)
    if pairs * (vd // bv) * (kd // bk) >= MIN_PROGRAMS:
      return bv, bk
  return min(vd, 32), min(kd, 32)


def state_warps(bv: int, bk: int, programs: int) -> int:
  """8 warps for a tile above 64 x 64 in a grid of under 2 * MIN_PROGRAMS programs, else 4
  (at 128 x 64: (8, 2048, 8, 128), 128 programs, 0.925 -> 0.907 ms with 8; GLA 340M's
  shape, 256 programs, 1.61 -> 1.49 with 4)."""
  return 8 if bv * bk > 64 * 64 and programs < 2 * MIN_PROGRAMS else 4


def split(kd: int, vd: int, kernel: str) -> int:
  """A per-chunk kernel's column block. o and dv: 128, so the whole V up to 128 columns (one
  program per chunk computes the chunk's attention once: at K = V = 128 the output kernel took
  0.200 -> 0.159 ms and dv 0.208 -> 0.150 against 64-wide blocks, H100, 2026-11-26). dq and
  dk: 64 (with 128 at K = V = 128 the dq/dk kernel took 0.362 -> 0.692 ms; at GLA 340M's
  K 128, V 256 fwd+bwd 1.95 -> 1.69 ms against 128)."""
  return SPLIT or (64 if kernel == "dqk" else 128)


# The largest head (K x V) whose tiles fit in an H100's shared memory, 16-bit inputs only:
# GLA 1.3B's 256 x 512 in bfloat16 runs (with the dq/dk kernel's loop over V); in float32
# even GLA 340M's 128 x 256 asked for 256 KiB of the 227 KiB available.
MAX_HEAD = 256 * 512
# Columns of V per step of the dq/dk kernel's loops over V (_sum_over_v). Where V fits one
# step the kernel reads v and do once per program for its three products (_columns).
V_STEP = 256


def supported(kd: int, vd: int, chunk: int, dtype, interpret: bool = False) -> bool:
  """Whether this path runs these shapes: Triton's power-of-two tiles, and on a GPU (not in
  interpret mode) tiles that fit the shared memory (fits_shared_memory)."""
  pow2 = lambda n: n >= 16 and n & (n - 1) == 0
  return (pow2(kd) and pow2(vd) and pow2(chunk)
          and (interpret or fits_shared_memory(kd, vd, dtype)))


def fits_shared_memory(kd: int, vd: int, dtype) -> bool:
  """16-bit inputs with K x V up to MAX_HEAD (measured on an H100: float32 tiles of GLA 340M's
  heads already overflow it, and float32 takes gla_gpu)."""
  return jnp.dtype(dtype).itemsize == 2 and kd * vd <= MAX_HEAD


def _dot(a, b, contract, dtype):
  """a . b contracting a's axis contract[0] with b's contract[1]; operands in dtype, f32 acc."""
  prec = lax.Precision.HIGHEST if dtype == F32 else lax.Precision.DEFAULT
  return lax.dot_general(a.astype(dtype), b.astype(dtype),
                         (((contract[0],), (contract[1],)), ((), ())),
                         precision=prec, preferred_element_type=F32)


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _gates(g):
  """(b [C, K] cumulative log-gate, tot [1, K] its chunk total), float32, from a log_g tile."""
  g = g.astype(F32)
  return jnp.cumsum(g, axis=0), jnp.sum(g, axis=0, keepdims=True)


def _row(x, u):
  """Row u of a [C, X] value as [1, X] (Pallas' Triton lowering has no value slicing)."""
  return jnp.sum(jnp.where(_iota((x.shape[0], 1), 0) == u, x, 0.0), axis=0, keepdims=True)


def _col(x, u):
  """Column u of a [C, C] value as [C, 1]."""
  return jnp.sum(jnp.where(_iota((1, x.shape[1]), 1) == u, x, 0.0), axis=1, keepdims=True)


def _eye(shape):
  return _iota(shape, 0) == _iota(shape, 1)


def _factorised(tot):
  return -jnp.min(tot) <= LIMIT


def _attention(qs, k, b, tot, keep, dt):
  """A [C, C] float32 (scale in qs), zero outside keep."""
  def fast():
    mid = 0.5 * tot
    off = _dot(qs * jnp.exp(b - mid), k * jnp.exp(mid - b), (1, 1), dt)
    return jnp.where(_eye(keep.shape), jnp.sum(qs * k, axis=1, keepdims=True), off)

  def exact():
    cols = _iota(keep.shape, 1)

    def key_row(u, a):
      term = qs * _row(k, u) * jnp.exp(jnp.minimum(b - _row(b, u), 0.0))
      return jnp.where(cols == u, jnp.sum(term, axis=1, keepdims=True), a)

    return lax.fori_loop(0, k.shape[0], key_row, jnp.zeros(keep.shape, F32))

  return jnp.where(keep, lax.cond(_factorised(tot), fast, exact), 0.0)


def _attention_grads(da, qs, k, b, tot, dt):
  """(d qs, dk, x) [C, K] float32 through A, from da = dL/dA (zero outside keep); x is these
  terms' part of q dq - k dk (d log_g's summand).

  In the factorised branch x is formed from the same rounded operands as the products,
  Qf (da Kf) - Kf (da^T Qf): each pair (t, u) then enters at t and leaves at u as the same
  float32 numbers, so d log_g's reverse cumulative sum cancels it (q dq - k dk from the
  rounded gradients would not, and the mismatch would add up along the sequence).
  """
  def fast():
    mid = 0.5 * tot
    up, down = jnp.exp(b - mid), jnp.exp(mid - b)
    eye = _eye(da.shape)
    da_self = jnp.sum(jnp.where(eye, da, 0.0), axis=1, keepdims=True)  # [C, 1]
    da_off = jnp.where(eye, 0.0, da)
    q_f = (qs * up).astype(dt).astype(F32)
    k_f = (k * down).astype(dt).astype(F32)
    to_q, to_k = _dot(da_off, k_f, (1, 0), dt), _dot(da_off, q_f, (0, 0), dt)
    # The self terms (t = u) add da_tt q_t k_t to both q dq and k dk: nothing to x.
    return up * to_q + da_self * k, down * to_k + da_self * qs, q_f * to_q - k_f * to_k

  def exact():
    rows = _iota((k.shape[0], 1), 0)

    def key_row(u, acc):
      dqs, dk = acc
      decay = jnp.exp(jnp.minimum(b - _row(b, u), 0.0))           # [C t, K], t's vs key u
      col = _col(da, u)                                           # [C t, 1]
      dqs += col * _row(k, u) * decay
      dk_u = jnp.sum(col * qs * decay, axis=0, keepdims=True)     # [1, K]
      return dqs, jnp.where(rows == u, dk_u, dk)

    zero = jnp.zeros(qs.shape, F32)
    dqs, dk = lax.fori_loop(0, k.shape[0], key_row, (zero, zero))
    return dqs, dk, qs * dqs - k * dk

  return lax.cond(_factorised(tot), fast, exact)


def _reset_masks(rc):
  """From a chunk's reset counts rc [C, 1]: (query sees S_n [C, 1], key reaches the chunk end
  [C, 1], the chunk passes its state on (scalar)). The last count is the largest: counts only
  grow within a chunk."""
  last = jnp.max(rc)
  return rc == 0.0, rc == last, last == 0.0


def _masks(rc_ref, rr_ref, c):
  """(keep [C, C], query sees S_n, key reaches the chunk end) of the per-chunk kernels; no
  masks but the causal one without resets."""
  causal = _iota((c, c), 1) <= _iota((c, c), 0)
  if rc_ref is None:
    return causal, None, None
  rc = rc_ref[...]                                                  # [C, 1]
  sees_state, reaches_end, _ = _reset_masks(rc)
  return causal & (rc == rr_ref[...]), sees_state, reaches_end


def _masked(x, mask):
  return x if mask is None else jnp.where(mask, x, 0.0)


# --- the sequential state kernels ---------------------------------------------------------


def _states_kernel(*refs, c, nt, reverse, scale, has_resets, has_init, has_last, prefetch):
  refs = list(refs)
  x_ref, y_ref, g_ref = refs[:3]
  rest = iter(refs[3:])
  take = lambda present: next(rest) if present else None
  rc_ref, init_ref = take(has_resets), take(has_init)
  # Reverse: also the forward's states (and its final one, needed only with a nonzero init), and
  # d log_g's part from the later chunks.
  fst_ref, flast_ref = take(reverse), take(reverse and has_init)
  st_ref, last_ref, later_ref = next(rest), take(has_last), take(reverse)
  dt = x_ref.dtype
  chunk_of = lambda i: nt - 1 - i if reverse else i

  def load(i):
    rows = pl.ds(pl.multiple_of(chunk_of(jnp.minimum(i, nt - 1)) * c, c), c)
    return (x_ref[rows, :], y_ref[rows, :], g_ref[rows, :],
            None if rc_ref is None else rc_ref[rows, :])

  def update(carry, n, tiles):
    st, leaving = carry if reverse else (carry, None)
    x, y, g, rc = tiles
    b, tot = _gates(g)
    decay = jnp.exp(tot)                                            # [1, BK]
    if reverse:  # x = q: scale q exp(b), for queries that see the entering state
      x = x.astype(F32) * (scale * jnp.exp(b))
    else:        # x = k: k exp(tot - b), for keys that reach the chunk end
      x = x.astype(F32) * jnp.exp(tot - b)
    if rc is not None:
      sees_state, reaches_end, passes_on = _reset_masks(rc)
      x = jnp.where(sees_state if reverse else reaches_end, x, 0.0)
      decay = jnp.where(passes_on, decay, 0.0)
    st_ref[n] = st.astype(st_ref.dtype)
    st = st * decay + _dot(y, x, (0, 0), dt)                        # [BV, BK]
    if not reverse:
      return st
    # The state leaving chunk n times its gradient (the carry's st), summed over V: d log_g at
    # chunk n + 1's first token, the part of every d log_g in chunk n that comes from the
    # later chunks (_dqk_kernel adds it); that gate scales this state wherever the later chunks
    # use it. The state leaving chunk n is the one entering n + 1, loaded in the step before
    # (the forward's final state in the first step, or zeros when the init dS is zero: the term
    # is zero then).
    later_ref[n] = jnp.sum(leaving * carry[0], axis=0)              # [BK]
    return st, fst_ref[n].astype(F32)

  zero = jnp.zeros(st_ref.shape[1:], F32)
  init = zero if init_ref is None else init_ref[...]
  if reverse:
    init = (init, zero if flast_ref is None else flast_ref[...])
  if prefetch:  # the next chunk's tiles are loaded before this chunk's arithmetic
    def body(i, carry):
      carry, tiles = carry
      nxt = load(i + 1)
      return update(carry, chunk_of(i), tiles), nxt
    last, _ = lax.fori_loop(0, nt, body, (init, load(0)))
  else:
    last = lax.fori_loop(0, nt, lambda i, carry: update(carry, chunk_of(i), load(i)), init)
  if last_ref is not None:
    last_ref[...] = last[0] if reverse else last


# Each kernel function is its own jit: a model calls it once per layer with the same shapes, and
# JAX then lowers (on jaxlib > 0.10.2: compiles with Triton) each kernel once, not once per
# layer and per rematerialisation (24 layers of GLA 340M did not compile in 6 minutes without).
# `knobs` (= _knobs() at the call) is a static argument only so that changing a module setting
# (LIMIT, SPLIT, ...: tests and benchmarks do) retraces instead of reusing a cached trace.
_kernel_jit = functools.partial(jax.jit, static_argnames=("c", "scale", "interpret", "knobs"))


def _knobs():
  return (LIMIT, SPLIT, STATE_BLOCK, STATE_STAGES, STATE_PREFETCH, NUM_WARPS, V_STEP)


@functools.partial(jax.jit,
                   static_argnames=("c", "reverse", "scale", "interpret", "knobs", "last"))
def _states(x, y, g, rc, init, fwd=None, *, c, reverse, scale, interpret, knobs, last=True):
  """Per-chunk states [B, H, NT, V, K] (x's dtype) and the final one [B, H, V, K] float32.

  Forward (x = k, y = v, init = S_0^T): entry n is S_n^T, the state entering chunk n.
  Reverse (x = q, y = do, init = dS^T at the end, fwd = the forward's two outputs): entry n is
  the gradient dS_n of the state leaving chunk n; the final one is dS_0^T; and a third output
  [B, H, NT, V / BV, K] float32, sum_v S dS_n with S the state leaving chunk n, one row per
  block of V rows: d log_g's part from the later chunks (_dqk_kernel adds the rows up).
  init None: zeros, read from no array (and in reverse the forward's final state is not read).
  last False: the final state is not written (None in its place).
  """
  del knobs  # a cache key (see _knobs)
  bsz, tp, h, kd = x.shape
  vd = y.shape[-1]
  nt = tp // c
  bv, bk = state_block(kd, vd, bsz * h)
  nk = kd // bk
  whole = lambda w, col: pl.BlockSpec((None, tp, None, w), lambda i, j, s: (i, 0, j, col(s)))
  kcol, vcol = (lambda s: s % nk), (lambda s: s // nk)
  tile = pl.BlockSpec((None, None, bv, bk), lambda i, j, s: (i, j, vcol(s), kcol(s)))
  in_specs = [whole(bk, kcol), whole(bv, vcol), whole(bk, kcol)]
  args = [x, y, g]
  if rc is not None:
    in_specs.append(pl.BlockSpec((None, tp, 1), lambda i, j, s: (i, 0, 0)))
    args.append(rc.reshape(bsz, tp, 1))
  kernel = functools.partial(_states_kernel, c=c, nt=nt, reverse=reverse, scale=scale,
                             has_resets=rc is not None, has_init=init is not None,
                             has_last=last, prefetch=STATE_PREFETCH)
  states = pl.BlockSpec((None, None, nt, bv, bk), lambda i, j, s: (i, j, 0, vcol(s), kcol(s)))
  if init is not None:
    in_specs.append(tile)
    args.append(init)
  if reverse:
    in_specs.append(states)
    args.append(fwd[0])
    if init is not None:
      in_specs.append(tile)
      args.append(fwd[1])
  out_specs = [states] + [tile] * last
  out_shape = [jax.ShapeDtypeStruct((bsz, h, nt, vd, kd), x.dtype)]
  out_shape += [jax.ShapeDtypeStruct((bsz, h, vd, kd), F32)] * last
  if reverse:
    out_specs.append(pl.BlockSpec((None, None, nt, None, bk),
                                  lambda i, j, s: (i, j, 0, vcol(s), kcol(s))))
    out_shape.append(jax.ShapeDtypeStruct((bsz, h, nt, vd // bv, kd), F32))
  warps = state_warps(bv, bk, bsz * h * (vd // bv) * nk)
  outs = pl.pallas_call(
      kernel, grid=(bsz, h, (vd // bv) * nk), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=STATE_STAGES),
      interpret=interpret)(*args)
  return outs if last else (outs[0], None, *outs[1:])


# --- the per-chunk kernels ----------------------------------------------------------------


class _Specs:
  """Block specs of the per-chunk kernels, grid (B, H, NT, column block s): a [B, Tp, H, X]
  token array's [C, w] tile (whole, or the s-th w-wide block of X), a [B, H, NT, V, K] state's
  tile, and the reset counts."""

  def __init__(self, c, rc):
    self.c, self.rc = c, rc

  def tok(self, w, blocked=False):
    return pl.BlockSpec((None, self.c, None, w),
                        lambda i, j, n, s: (i, n, j, s if blocked else 0))

  def state(self, rows, cols, blocked_rows=False, blocked_cols=False):
    return pl.BlockSpec((None, None, None, rows, cols),
                        lambda i, j, n, s: (i, j, n, s if blocked_rows else 0,
                                            s if blocked_cols else 0))

  def resets(self):
    if self.rc is None:
      return []
    return [pl.BlockSpec((None, self.c, 1), lambda i, j, n, s: (i, n, 0)),
            pl.BlockSpec((None, None, 1, self.c), lambda i, j, n, s: (i, n, 0, 0))]

  def reset_args(self):
    if self.rc is None:
      return []
    bsz, tp = self.rc.shape
    return [self.rc.reshape(bsz, tp, 1), self.rc.reshape(bsz, tp // self.c, 1, self.c)]


def _call(kernel, specs, grid, in_specs, out_specs, out_shape, width, interpret, *args, **kw):
  kernel = functools.partial(kernel, c=specs.c, has_resets=specs.rc is not None, **kw)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs + specs.resets(), out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=_warps(width), num_stages=1),
      interpret=interpret)(*args, *specs.reset_args())


def _warps(width):
  """Warps of a per-chunk program whose widest tile is ``width`` columns: 4 up to 128 (8, as
  before, was slower at K = V = 128: fwd+bwd 1.29 -> 1.11 ms at 8, 2048, 8, 128), else 8 (4
  spills at GLA 340M's 256-wide V: 1.92 -> 2.85 ms)."""
  return NUM_WARPS or (4 if width <= 128 else 8)


def _split_refs(refs, n_in, has_resets):
  ins = refs[:n_in]
  resets = refs[n_in:n_in + 2] if has_resets else (None, None)
  return ins, resets, refs[n_in + (2 if has_resets else 0):]


def _output_kernel(*refs, scale, c, has_resets):
  (q_ref, k_ref, v_ref, g_ref, st_ref), (rc_ref, rr_ref), (o_ref,) = _split_refs(
      refs, 5, has_resets)
  dt = q_ref.dtype
  keep, sees_state, _ = _masks(rc_ref, rr_ref, c)
  qs = q_ref[...].astype(F32) * scale
  b, tot = _gates(g_ref[...])
  a = _attention(qs, k_ref[...].astype(F32), b, tot, keep, dt)
  o = (_dot(_masked(qs * jnp.exp(b), sees_state), st_ref[...], (1, 1), dt)
       + _dot(a.astype(dt), v_ref[...], (1, 0), dt))
  o_ref[...] = o.astype(o_ref.dtype)


@_kernel_jit
def _output(q, k, v, g, rc, st, *, scale, c, interpret, knobs):
  """o, one program per (chunk, block of V columns): A is recomputed per block."""
  del knobs  # a cache key (see _knobs)
  bsz, tp, h, kd = q.shape
  vd = v.shape[-1]
  bv = min(vd, split(kd, vd, "output"))
  sp = _Specs(c, rc)
  return _call(_output_kernel, sp, (bsz, h, tp // c, vd // bv),
               [sp.tok(kd), sp.tok(kd), sp.tok(bv, True), sp.tok(kd), sp.state(bv, kd, True)],
               sp.tok(bv, True), jax.ShapeDtypeStruct((bsz, tp, h, vd), q.dtype),
               max(kd, bv), interpret, q, k, v, g, st, scale=scale)


def _dv_kernel(*refs, scale, c, has_resets):
  (q_ref, k_ref, g_ref, do_ref, dst_ref), (rc_ref, rr_ref), (dv_ref,) = _split_refs(
      refs, 5, has_resets)
  dt = q_ref.dtype
  keep, _, reaches_end = _masks(rc_ref, rr_ref, c)
  k = k_ref[...].astype(F32)
  b, tot = _gates(g_ref[...])
  a = _attention(q_ref[...].astype(F32) * scale, k, b, tot, keep, dt)
  k_out = _masked(jnp.exp(tot - b), reaches_end)
  dv = _dot(a.astype(dt), do_ref[...], (0, 0), dt) + _dot(k * k_out, dst_ref[...], (1, 1), dt)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _sum_over_v(vd, product):
  """sum over column blocks of V of product(cols), V_STEP columns at a time: whole V tiles of
  wide heads overflow the shared memory (GLA 1.3B's 512-wide V asked for 256 KiB of the
  H100's 227)."""
  step = min(vd, V_STEP)
  if vd == step:
    return product(slice(None))
  first = product(pl.ds(0, step))
  add = lambda j, acc: acc + product(pl.ds(pl.multiple_of(j * step, step), step))
  return lax.fori_loop(1, vd // step, add, first)


def _columns(ref):
  """cols -> ref[:, cols] for _sum_over_v's products: where V fits one V_STEP, ref read here
  once and the same value returned for the whole of V (H100, (8, 2048, 16, 64) fwd+bwd
  0.989 -> 0.897 ms against a read per product; docs/kernels.md); else read on every call."""
  if ref.shape[1] > V_STEP:
    return lambda cols: ref[:, cols]
  x = ref[...]
  return lambda cols: x


def _dqk_kernel(*refs, scale, c, has_resets):
  (q_ref, k_ref, v_ref, g_ref, do_ref, st_ref, dst_ref, later_ref), (rc_ref, rr_ref), (
      dq_ref, dk_ref, dg_ref) = _split_refs(refs, 8, has_resets)
  dt = q_ref.dtype
  keep, sees_state, reaches_end = _masks(rc_ref, rr_ref, c)
  q = q_ref[...].astype(F32)
  k = k_ref[...].astype(F32)
  vd = v_ref.shape[1]
  v_at, do_at = _columns(v_ref), _columns(do_ref)
  qs = q * scale
  b, tot = _gates(g_ref[...])
  da = _sum_over_v(vd, lambda cols: _dot(do_at(cols), v_at(cols), (1, 1), dt))
  dqs, dk, x = _attention_grads(jnp.where(keep, da, 0.0), qs, k, b, tot, dt)  # [C t, C u]
  do_st = _sum_over_v(vd, lambda cols: _dot(do_at(cols), st_ref[cols, :], (1, 0), dt))
  dqs_in = _masked(jnp.exp(b), sees_state) * do_st
  v_dst = _sum_over_v(vd, lambda cols: _dot(v_at(cols), dst_ref[cols, :], (1, 0), dt))
  dk_out = _masked(jnp.exp(tot - b), reaches_end) * v_dst
  dq = (dqs + dqs_in) * scale
  dk += dk_out
  x += qs * dqs_in - k * dk_out                                     # q dq - k dk: dL/d(b)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  # d log_g_t: the sum of x over the chunk from t on (total minus forward cumulative sum: the
  # lowering has only the forward one), plus d log_g at the next chunk's first token: the
  # later chunks' part, sum_v S dS of the state leaving this chunk (the reverse state kernel
  # gives it per block of V rows). Computing it here instead cost more registers than it saved
  # (docs/kernels.md).
  later = jnp.sum(later_ref[...], axis=0, keepdims=True)            # [1, BK]
  dg_ref[...] = (jnp.sum(x, axis=0, keepdims=True) - jnp.cumsum(x, axis=0) + x
                 + later).astype(dg_ref.dtype)


@_kernel_jit
def _grads(q, k, v, g, do, rc, st, dst, later, *, scale, c, interpret, knobs):
  """(dq, dk, dv, d log_g): two kernels, dv per (chunk, block of V columns) and the rest per
  (chunk, block of K columns); each recomputes what it needs.
  (st, dst: [B, H, NT, V, K], S_n^T and the gradient of the leaving state, transposed.)"""
  del knobs  # a cache key (see _knobs)
  bsz, tp, h, kd = q.shape
  vd = v.shape[-1]
  bv, bk = min(vd, split(kd, vd, "dv")), min(kd, split(kd, vd, "dqk"))
  sp = _Specs(c, rc)
  nt = tp // c
  dv = _call(_dv_kernel, sp, (bsz, h, nt, vd // bv),
             [sp.tok(kd), sp.tok(kd), sp.tok(kd), sp.tok(bv, True), sp.state(bv, kd, True)],
             sp.tok(bv, True), jax.ShapeDtypeStruct(v.shape, v.dtype), max(kd, bv),
             interpret, q, k, g, do, dst, scale=scale)
  dq, dk, dg = _call(
      _dqk_kernel, sp, (bsz, h, nt, kd // bk),
      [sp.tok(bk, True), sp.tok(bk, True), sp.tok(vd), sp.tok(bk, True), sp.tok(vd),
       sp.state(vd, bk, blocked_cols=True), sp.state(vd, bk, blocked_cols=True),
       sp.state(later.shape[3], bk, blocked_cols=True)],
      [sp.tok(bk, True)] * 3,
      [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
       jax.ShapeDtypeStruct(g.shape, g.dtype)], max(bk, vd), interpret,
      q, k, v, g, do, st, dst, later, scale=scale)
  return dq, dk, dv, dg


# --- the function -------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def gla(scale, c, interpret, q, k, v, g, s0, rc):
  """o [B, Tp, H, V] (q's dtype), h_last [B, H, K, V] float32; Tp a multiple of c.

  q, k, g: [B, Tp, H, K]; v: [B, Tp, H, V] (k, v in q's dtype); s0 [B, H, K, V] float32 or
  None (zeros); rc [B, Tp] float32 reset counts (gla_reference.chunk_reset_counts) or None.
  """
  return _forward(scale, c, interpret, q, k, v, g, s0, rc)[0]


def _forward(scale, c, interpret, q, k, v, g, s0, rc):
  kw = dict(c=c, scale=scale, interpret=interpret, knobs=_knobs())
  init = None if s0 is None else jnp.swapaxes(s0, -1, -2)
  st, last = _states(k, v, g, rc, init, reverse=False, **kw)
  o = _output(q, k, v, g, rc, st, **kw)
  return (o, jnp.swapaxes(last, -1, -2)), (q, k, v, g, s0, rc, st, last)


def _fwd(scale, c, interpret, *primals):
  # Symbolic zeros (defvjp below): the primals come wrapped; only their values matter here.
  return _forward(scale, c, interpret, *(None if p is None else p.value for p in primals))


def _bwd(scale, c, interpret, res, cts):
  """Unused outputs' cotangents arrive as symbolic zeros: a zero dS at the end (h_last unused,
  as in a model's training step) is neither built nor read, and without s0 no dS_0 is written."""
  q, k, v, g, s0, rc, st, last = res
  do, ds_last = cts
  kw = dict(c=c, scale=scale, interpret=interpret, knobs=_knobs())
  zero = lambda ct: isinstance(ct, jax.custom_derivatives.SymbolicZero)
  do = jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype) if zero(do) else do.astype(q.dtype)
  init = None if zero(ds_last) else jnp.swapaxes(ds_last.astype(F32), -1, -2)
  dst, ds0, later = _states(q, do, g, rc, init, (st, last), reverse=True,
                            last=s0 is not None, **kw)
  dq, dk, dv, dlog_g = _grads(q, k, v, g, do, rc, st, dst, later, **kw)
  ds0 = None if s0 is None else jnp.swapaxes(ds0, -1, -2).astype(s0.dtype)
  return (dq, dk, dv, dlog_g.astype(g.dtype), ds0, None)


gla.defvjp(_fwd, _bwd, symbolic_zeros=True)
