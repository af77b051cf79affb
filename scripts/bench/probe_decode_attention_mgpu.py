"""Probe for issue #18 (a): MQA's decode attention on the tensor cores as a Mosaic GPU kernel.

MQA's decoding step spends most of its time reading the KV cache through JAX's Triton decode
kernel (docs/inference.md). This probe asks how fast a Hopper kernel can read it while doing
the attention's arithmetic: one CTA per row, the row's query heads (16 at 1.3B) padded to
wgmma's 64 rows, one compute warpgroup (q k^T and p v on the tensor cores, an online softmax in
registers) and one memory warpgroup streaming the row's keys and values through a TMA ring.
``mqa_decode`` takes full rows (every row holds T keys); ``mqa_decode_ragged`` (key splits and a
combine) and ``mqa_decode_rows`` (one warpgroup, a TMA ring bounded by the row's length) read
only each row's filled part, as the model's decoding path does. Checked against a float32 reference in the run; timed
beside the Triton kernel, a bare TMA reader of the same bytes (probe_overlap_mgpu.py) and the
copy ceiling of a jitted ``x + 1``. Results: docs/bench/decode_log.md, session 41.

    python scripts/bench/probe_decode_attention_mgpu.py
"""
import argparse
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import probe_overlap_mgpu as po  # scripts/bench/
import timing

QP = 64  # query rows a CTA: the heads, padded


def mqa_decode(q, k, v, *, bk=128, stages=2):
  """q [B, H, D] (H <= 64), k, v [B, T, D] -> [B, H, D]; softmax(q k^T) v, no scale."""
  B, H, D = q.shape
  T = k.shape[1]
  qp = jnp.zeros((B, QP, D), q.dtype).at[:, :H].set(q)

  def body(q_g, k_g, v_g, o_g, q_s, bar):
    b = lax.axis_index("row")

    def ctx(run):
      plgpu.copy_gmem_to_smem(q_g.at[b], q_s, bar)
      plgpu.barrier_wait(bar)
      acc = jnp.zeros((QP, D), jnp.float32)
      m = jnp.full((QP,), -jnp.inf, jnp.float32)
      l = jnp.zeros((QP,), jnp.float32)
      acc, m, l = run((acc, m, l))
      acc = acc / lax.broadcast_in_dim(l, (QP, D), [0])
      q_s[...] = acc.astype(q_s.dtype)  # the query tile is free now: the output goes through it
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_s, o_g.at[b])
      plgpu.wait_smem_to_gmem(0)

    def step(idxs, k_s, v_s, carry):
      del idxs
      acc, m, l = carry

      def qk(ref):
        plgpu.wgmma(ref, q_s, plgpu.transpose_ref(k_s, (1, 0)))
        return ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((QP, bk), jnp.float32))
      log2e = math.log2(math.e)
      m_new = jnp.maximum(m, s.max(axis=1) * log2e)
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s * log2e - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def pv(ref):
        plgpu.wgmma(ref, p.astype(v_s.dtype), v_s)
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      return acc, m_new, l

    pipe = plgpu.emit_pipeline_warp_specialized(
        step, grid=(T // bk,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((bk, D), lambda i: (i, 0)),
                  plgpu.BlockSpec((bk, D), lambda i: (i, 0))],
        wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages, compute_context=ctx)
    pipe(k_g.at[b], v_g.at[b])

  out = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((B, QP, D), q.dtype), grid=(B,), grid_names=("row",),
      num_threads=2, thread_name="wg",
      scratch_types=(plgpu.SMEM((QP, D), q.dtype),
                     plgpu.Barrier(num_barriers=1)),
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(qp, k, v)
  return out[:, :H]


def mqa_decode_ragged(q, k, v, lengths, *, bk=128, stages=2, split=512):
  """The same over the first ``lengths[b]`` keys of each row: CTAs over (row, split of
  ``split`` keys); a split past the row's length does nothing, and steps past it within a split
  re-read the split's last filled tile (from L2) and are masked. Each split writes its 16 rows'
  unnormalised output, running max and sum; XLA combines the splits."""
  B, H, D = q.shape
  T = k.shape[1]
  S, per = T // split, split // bk
  qp = jnp.zeros((B, QP, D), q.dtype).at[:, :H].set(q)
  log2e = math.log2(math.e)

  def body(len_g, q_g, k_g, v_g, o_g, ml_g, q_s, o_s, ml_s, bar):
    b, sp = lax.axis_index("row"), lax.axis_index("split")
    n = len_g[b]
    last = (n - 1) // bk - sp * per  # the split's last tile that holds keys, if any

    @pl.when(sp * split < n)
    def _active():
      def ctx(run):
        plgpu.copy_gmem_to_smem(q_g.at[b], q_s, bar)
        plgpu.barrier_wait(bar)
        acc = jnp.zeros((QP, D), jnp.float32)
        m = jnp.full((QP,), -jnp.inf, jnp.float32)
        l = jnp.zeros((QP,), jnp.float32)
        acc, m, l = run((acc, m, l))
        o_s[...] = acc
        ml_s[0] = m
        ml_s[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, H)], o_g.at[b, sp])
        plgpu.copy_smem_to_gmem(ml_s, ml_g.at[b, sp])
        plgpu.wait_smem_to_gmem(0)

      def step(idxs, k_s, v_s, carry):
        (i,) = idxs
        acc, m, l = carry

        def qk(ref):
          plgpu.wgmma(ref, q_s, plgpu.transpose_ref(k_s, (1, 0)))
          return ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((QP, bk), jnp.float32))
        key = (plgpu.broadcasted_iota(jnp.int32, (QP, bk), 1, layout=plgpu.Layout.WGMMA)
               + lax.broadcast_in_dim((sp * per + i) * bk, (QP, bk), ()))
        s = jnp.where(key < lax.broadcast_in_dim(n, (QP, bk), ()), s,
                      lax.broadcast_in_dim(jnp.float32(-jnp.inf), (QP, bk), ()))
        m_new = jnp.maximum(m, s.max(axis=1) * log2e)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * log2e - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        def pv(ref):
          plgpu.wgmma(ref, p.astype(v_s.dtype), v_s)
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        return acc, m_new, l

      tile = lambda i: (sp * per + jnp.minimum(i, last), 0)
      pipe = plgpu.emit_pipeline_warp_specialized(
          step, grid=(per,), memory_registers=40,
          in_specs=[plgpu.BlockSpec((bk, D), tile), plgpu.BlockSpec((bk, D), tile)],
          wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages, compute_context=ctx)
      pipe(k_g.at[b], v_g.at[b])

  o, ml = plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((B, S, H, D), jnp.float32),
                      jax.ShapeDtypeStruct((B, S, 2, QP), jnp.float32)),
      grid=(B, S), grid_names=("row", "split"), num_threads=2, thread_name="wg",
      scratch_types=(plgpu.SMEM((QP, D), q.dtype), plgpu.SMEM((QP, D), jnp.float32),
                     plgpu.SMEM((2, QP), jnp.float32), plgpu.Barrier(num_barriers=1)),
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(lengths.astype(jnp.int32), qp, k, v)
  active = (jnp.arange(S) * split < lengths[:, None])[:, :, None]  # [B, S, 1]
  m = jnp.where(active, ml[:, :, 0, :H], -jnp.inf)  # inactive splits were never written
  l = jnp.where(active, ml[:, :, 1, :H], 0.0)
  o = jnp.where(active[..., None], o, 0.0)
  top = m.max(axis=1, keepdims=True)
  w = jnp.exp2(m - top)  # [B, S, H]
  out = (o * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
  return out.astype(q.dtype)


def mqa_decode_rows(q, k, v, lengths, *, bk=64, stages=3):
  """Each row's filled part, one CTA a row: one warpgroup runs a hand-written TMA ring whose
  loop stops at the row's last filled tile (no splits, no combine); the last tile is masked."""
  B, H, D = q.shape
  T = k.shape[1]
  qp = jnp.zeros((B, QP, D), q.dtype).at[:, :H].set(q)
  log2e = math.log2(math.e)

  def body(len_g, q_g, k_g, v_g, o_g, q_s, k_s, v_s, loaded, q_bar):
    b = lax.axis_index("row")
    n = len_g[b]
    nt = (n + bk - 1) // bk

    def fetch(t, slot):
      plgpu.copy_gmem_to_smem(k_g.at[b, pl.ds(t * bk, bk)], k_s.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_g.at[b, pl.ds(t * bk, bk)], v_s.at[slot], loaded.at[slot])

    plgpu.copy_gmem_to_smem(q_g.at[b], q_s, q_bar)
    lax.fori_loop(0, jnp.minimum(stages, nt), lambda t, _: fetch(t, t), None)
    plgpu.barrier_wait(q_bar)

    def step(t, carry):
      acc, m, l = carry
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(loaded.at[slot])

      def qk(ref):
        plgpu.wgmma(ref, q_s, plgpu.transpose_ref(k_s.at[slot], (1, 0)))
        return ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((QP, bk), jnp.float32))
      key = (plgpu.broadcasted_iota(jnp.int32, (QP, bk), 1, layout=plgpu.Layout.WGMMA)
             + lax.broadcast_in_dim(t * bk, (QP, bk), ()))
      s = jnp.where(key < lax.broadcast_in_dim(n, (QP, bk), ()), s,
                    lax.broadcast_in_dim(jnp.float32(-jnp.inf), (QP, bk), ()))
      m_new = jnp.maximum(m, s.max(axis=1) * log2e)
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s * log2e - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def pv(ref):
        plgpu.wgmma(ref, p.astype(v_s.dtype), v_s.at[slot])
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      plgpu.commit_smem()  # every thread is past this slot before it is refilled

      @pl.when(t + stages < nt)
      def _():
        fetch(t + stages, slot)
      return acc, m_new, l

    init = (jnp.zeros((QP, D), jnp.float32), jnp.full((QP,), -jnp.inf, jnp.float32),
            jnp.zeros((QP,), jnp.float32))
    acc, _, l = lax.fori_loop(0, nt, step, init)
    q_s[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(q_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, o_g.at[b])
    plgpu.wait_smem_to_gmem(0)

  out = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((B, QP, D), q.dtype), grid=(B,), grid_names=("row",),
      scratch_types=(plgpu.SMEM((QP, D), q.dtype), plgpu.SMEM((stages, bk, D), k.dtype),
                     plgpu.SMEM((stages, bk, D), v.dtype),
                     plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier()),
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(lengths.astype(jnp.int32), qp, k, v)
  return out[:, :H]


def reference(q, k, v, lengths=None):
  s = jnp.einsum("bhd,btd->bht", q.astype(jnp.float32), k.astype(jnp.float32))
  if lengths is not None:
    s = jnp.where(jnp.arange(k.shape[1]) < lengths[:, None, None], s, -jnp.inf)
  return jnp.einsum("bht,btd->bhd", jax.nn.softmax(s, -1), v.astype(jnp.float32))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=1024)
  ap.add_argument("--keys", type=int, default=2048)
  args = ap.parse_args()
  B, T, H, D = args.rows, args.keys, 16, 128
  k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
  q = (jax.random.normal(k0, (B, H, D), jnp.float32) / D**0.5).astype(jnp.bfloat16)
  k = jax.random.normal(k1, (B, T, D), jnp.bfloat16)
  v = jax.random.normal(k2, (B, T, D), jnp.bfloat16)
  want = reference(q, k, v)
  nbytes = 2 * B * T * D * 2
  ceiling = timing.copy_ceiling(1 << 30) / 1e12  # TB/s
  print(f"{jax.devices()[0].device_kind}: copy ceiling (x + 1) {ceiling:.2f} TB/s; "
        f"K+V {nbytes / 1e9:.2f} GB")
  from jax.experimental.pallas.ops.gpu import decode_attention  # pylint: disable=g-import-not-at-top
  lengths = jnp.full((B,), T, jnp.int32)
  ours = jax.jit(lambda q, k, v: decode_attention.mqa(q, k, v, kv_seq_len=lengths, sm_scale=1.0,
                                                      block_k=128, k_splits=T // 128))
  print(f"Triton (ours) err {float(jnp.abs(ours(q, k, v).astype(jnp.float32) - want).max()):.3g}")
  t = po.timeit(ours, q, k, v)
  print(f"Triton decode_attention: {t:.3f} ms, {nbytes / t / 1e9:.2f} TB/s")
  G = jax.devices()[0].core_count
  R = (nbytes // 512) // (G * po.RT) * G * po.RT
  buf = jnp.zeros((R, 256), jnp.bfloat16)
  t = po.timeit(jax.jit(lambda x: po.fused(None, None, x, G, G)), buf)
  print(f"bare TMA reader of {buf.nbytes / 1e9:.2f} GB on all SMs: {t:.3f} ms, "
        f"{buf.nbytes / t / 1e9:.2f} TB/s")
  for bk, st in [(128, 2), (64, 3), (64, 4)]:
    try:
      f = jax.jit(functools.partial(mqa_decode, bk=bk, stages=st))
      err = float(jnp.abs(f(q, k, v).astype(jnp.float32) - want).max())
      t = po.timeit(f, q, k, v)
      print(f"Mosaic, {bk} keys a step, {st} stages: {t:.3f} ms, {nbytes / t / 1e9:.2f} TB/s, "
            f"err {err:.3g}")
    except Exception as e:  # pylint: disable=broad-except
      print(f"Mosaic {bk}, {st} failed: {type(e).__name__}: {str(e)[:400]}")
  # Each row's filled part: lengths uniform in [1, T] (a decode loop's average), then all full.
  lengths = jax.random.randint(jax.random.key(1), (B,), 1, T + 1)
  want_r = reference(q, k, v, lengths)
  ours_r = jax.jit(lambda q, k, v, n: decode_attention.mqa(
      q, k, v, kv_seq_len=n, sm_scale=1.0, block_k=128, k_splits=T // 128))
  err_o = float(jnp.abs(ours_r(q, k, v, lengths).astype(jnp.float32) - want_r).max())
  t_ours = po.timeit(ours_r, q, k, v, lengths)
  print(f"ragged lengths, Triton decode_attention: {t_ours:.3f} ms (err {err_o:.3g})")
  for bk, st in [(64, 3), (64, 2), (128, 2)]:
    try:
      f = jax.jit(functools.partial(mqa_decode_rows, bk=bk, stages=st))
      err_r = float(jnp.abs(f(q, k, v, lengths).astype(jnp.float32) - want_r).max())
      err_f = float(jnp.abs(f(q, k, v, jnp.full((B,), T)).astype(jnp.float32) - want).max())
      t_r = po.timeit(f, q, k, v, lengths)
      t_f = po.timeit(f, q, k, v, jnp.full((B,), T))
      print(f"rows Mosaic (one warpgroup, length-bounded ring), {bk} keys a step, {st} stages: "
            f"ragged {t_r:.3f} ms (err {err_r:.3g}); full rows {t_f:.3f} ms (err {err_f:.3g})")
    except Exception as e:  # pylint: disable=broad-except
      print(f"rows {bk}, {st} failed: {type(e).__name__}: {str(e)[:600]}")
  for bk, st, split in [(128, 2, 512)]:
    try:
      f = jax.jit(functools.partial(mqa_decode_ragged, bk=bk, stages=st, split=split))
      err_r = float(jnp.abs(f(q, k, v, lengths).astype(jnp.float32) - want_r).max())
      err_f = float(jnp.abs(f(q, k, v, jnp.full((B,), T)).astype(jnp.float32) - want).max())
      t_r = po.timeit(f, q, k, v, lengths)
      t_f = po.timeit(f, q, k, v, jnp.full((B,), T))
      print(f"ragged Mosaic, {bk} keys a step, {st} stages, splits of {split}: ragged "
            f"{t_r:.3f} ms (err {err_r:.3g}); full rows {t_f:.3f} ms (err {err_f:.3g})")
    except Exception as e:  # pylint: disable=broad-except
      print(f"ragged {bk}, {st}, {split} failed: {type(e).__name__}: {str(e)[:600]}")


if __name__ == "__main__":
  main()
