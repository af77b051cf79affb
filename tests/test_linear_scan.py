"""The RG-LRU linear-scan kernels against float64 references, forward and backward.

The Pallas kernels run on the CPU: the TPU kernel in TPU interpret mode (the public entry points'
choice on a CPU backend) and the GPU kernel in Pallas' generic interpreter. Shapes are small but
odd (T=1, T not a multiple of any block, D not a multiple of 128, partial batch tiles) and
block sizes are shrunk where a test must cross several blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

import pallas_kernels
from pallas_kernels.rg_lru import blocked, gpu_mosaic, reference
from pallas_kernels.rg_lru.fused import rg_lru_with_config
from pallas_kernels.rg_lru.scan import linear_scan_with_config

TPU_SMALL_BLOCKS = blocked.ScanConfig(backend="tpu", interpret=True, block_b=2, block_t=32,
                                        block_d=128)
GPU_INTERPRET = blocked.ScanConfig(backend="gpu", interpret=True, gpu_block_d=64, gpu_chunk=8)
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), "non-finite values"
  # An exactly-zero reference (da at T=1 from h0 = 0) must be matched exactly.
  return np.linalg.norm(got - want) / (np.linalg.norm(want) or 1.0)


def f64(v):
  return jnp.asarray(np.asarray(v, np.float64))


def scan_inputs(seed, shape, dtype):
  kx, ka, kh, ky = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = jax.random.normal(kx, shape).astype(dtype)
  # Decays over (0.3, 1): states neither vanish at once nor blow up.
  a = jax.random.uniform(ka, shape, minval=0.3, maxval=1.0).astype(dtype)
  h0 = jax.random.normal(kh, (shape[0], shape[2]), jnp.float32)
  dy = jax.random.normal(ky, shape).astype(dtype)
  return x, a, h0, dy


def check_scan(scan, shape, dtype, reverse, with_h0, seed):
  """``scan(x, a[, h0], reverse=...)`` vs ``jax.vjp`` of the float64 lax.scan reference."""
  x, a, h0, dy = scan_inputs(seed, shape, dtype)
  dh_last = jax.random.normal(jax.random.PRNGKey(seed + 1), h0.shape)
  args = (x, a, h0) if with_h0 else (x, a)
  (y, h_last), vjp = jax.vjp(lambda *v: scan(*v, reverse=reverse), *args)
  assert y.dtype == dtype and y.shape == shape
  assert h_last.dtype == jnp.float32 and h_last.shape == h0.shape
  grads = vjp((dy, dh_last))
  with jax.enable_x64(True):
    ref_fn = lambda *v: reference.linear_scan_reference(*v, reverse=reverse)
    (y_ref, h_ref), ref_vjp = jax.vjp(ref_fn, *map(f64, args))
    ref_grads = ref_vjp((f64(dy), f64(dh_last)))
  tol = TOLERANCE[dtype]
  assert rel_err(y, y_ref) < tol  # bfloat16 y carries its rounding (~4e-3)
  # h_last stays float32 and sees the bfloat16 inputs exactly: float32 accuracy either way.
  assert rel_err(h_last, h_ref) < 1e-5
  for name, g, g_ref in zip(("dx", "da", "dh0"), grads, ref_grads):
    assert rel_err(g, g_ref) < tol, name


@pytest.mark.parametrize("shape,dtype,reverse,with_h0", [
    ((2, 257, 200), jnp.float32, False, True),
    ((3, 1, 5), jnp.float32, True, False),
    ((1, 40, 130), jnp.bfloat16, True, True),
])
def test_linear_scan_public_entry(shape, dtype, reverse, with_h0):
  check_scan(pallas_kernels.linear_scan, shape, dtype, reverse, with_h0, seed=sum(shape))


@pytest.mark.parametrize("config,reverse", [
    (TPU_SMALL_BLOCKS, True),   # several time blocks, a partial batch and channel tile
    (GPU_INTERPRET, False),     # chunked loop + tail + peeled last step, masked channels
    (GPU_INTERPRET, True),
])
def test_linear_scan_kernels_across_blocks(config, reverse):
  def scan(x, a, h0, reverse):
    return linear_scan_with_config(x, a, h0, reverse, config)
  check_scan(scan, (3, 75, 200), jnp.float32, reverse, True, seed=7)


def test_linear_scan_bfloat16_gpu_kernel():
  def scan(x, a, h0, reverse):
    return linear_scan_with_config(x, a, h0, reverse, GPU_INTERPRET)
  check_scan(scan, (2, 33, 70), jnp.bfloat16, False, True, seed=3)


def test_linear_scan_gpu_kernel_deeper_prefetch():
  # Three chunks loaded ahead of the one computed: clamped reloads at the end, then the tail.
  config = blocked.ScanConfig(backend="gpu", interpret=True, gpu_block_d=64, gpu_chunk=4,
                                gpu_prefetch=3)
  def scan(x, a, h0, reverse):
    return linear_scan_with_config(x, a, h0, reverse, config)
  check_scan(scan, (2, 30, 70), jnp.bfloat16, True, True, seed=5)


@pytest.mark.parametrize("dtype,reverse", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_mosaic_gpu_scan_forward(dtype, reverse):
  # Pallas' Mosaic GPU interpreter: several pipeline steps (fewer slots than steps), a short
  # last time tile and a partial channel block (T=37, D=200 with 8-row tiles, 128 channels).
  shape = (2, 37, 200)
  x, a, h0, _ = scan_inputs(11, shape, dtype)
  y, h_last = gpu_mosaic.linear_scan_mgpu(x, a, h0, reverse=reverse, rows=8, block_d=128,
                                               stages=3, interpret=True)
  assert y.dtype == dtype and y.shape == shape and h_last.dtype == jnp.float32
  with jax.enable_x64(True):
    y_ref, h_ref = reference.linear_scan_reference(f64(x), f64(a), f64(h0),
                                                        reverse=reverse)
  assert rel_err(y, y_ref) < TOLERANCE[dtype]
  assert rel_err(h_last, h_ref) < 1e-5


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_scan_with_the_mosaic_gpu_forward(reverse):
  # linear_scan's custom VJP with the Mosaic GPU forward (its interpreter) and the Triton
  # backward (Pallas' interpreter): values and gradients against float64.
  config = blocked.ScanConfig(backend="gpu", interpret=True, gpu_block_d=64, gpu_chunk=4,
                                gpu_forward="mosaic")
  def scan(x, a, h0, reverse):
    return linear_scan_with_config(x, a, h0, reverse, config)
  check_scan(scan, (2, 45, 136), jnp.bfloat16, reverse, True, seed=13)


def test_mosaic_gpu_scan_defaults_and_choice():
  # The default tiles (the GPU-checked configuration) over more tiles than stages, ragged T and
  # D, in the interpreter; and the forward is Mosaic GPU only where TMA exists.
  shape = (1, 150, 200)
  x, a, h0, _ = scan_inputs(12, shape, jnp.bfloat16)
  y, h_last = gpu_mosaic.linear_scan_mgpu(x, a, h0, interpret=True)
  with jax.enable_x64(True):
    y_ref, h_ref = reference.linear_scan_reference(f64(x), f64(a), f64(h0))
  assert rel_err(y, y_ref) < TOLERANCE[jnp.bfloat16] and rel_err(h_last, h_ref) < 1e-5
  assert [gpu_mosaic.tma_capable(c) for c in ("8.0", "8.9", "9.0", "10.0")] == [
      False, False, True, True]
  assert not gpu_mosaic.supports(jnp.zeros((1, 4, 7), jnp.bfloat16),
                                      jnp.zeros((1, 4, 7), jnp.bfloat16))  # 14-byte rows


def test_linear_scan_rejects_bad_shapes():
  x = jnp.zeros((2, 8, 4))
  with pytest.raises(ValueError):
    pallas_kernels.linear_scan(x, x[:, :4])
  with pytest.raises(ValueError):
    pallas_kernels.linear_scan(x, x, jnp.zeros((2, 5)))


def layer_inputs(seed, shape, dtype):
  B, T, D = shape
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  x, gate_x, gate_a = (jax.random.normal(k, shape).astype(dtype) for k in ks[:3])
  a_param = jax.random.normal(ks[3], (D,))
  # A few channels with a -> 1, where 1 - a^2 falls under the bound on sqrt's derivative.
  a_param = a_param.at[: D // 8].set(-20.0)
  reset = jax.random.uniform(ks[4], (B, T)) < 0.1
  h0 = jax.random.normal(ks[5], (B, D))
  dy = jax.random.normal(ks[6], shape).astype(dtype)
  return (x, gate_x, gate_a, a_param, h0), reset, dy


def assert_layer_matches_float64(fwd, args, reset, dy, dtype, *, seed, h_tol=1e-5):
  """``fwd(x, gate_x, gate_a, a_param, h0) -> (y, h_last)``: values, h_last and every gradient,
  for cotangents of y and of h_last, against the one long float64 scan. Returns ``(y, h_last)``."""
  dh_last = jax.random.normal(jax.random.PRNGKey(seed), args[-1].shape)
  (y, h_last), vjp = jax.vjp(fwd, *args)
  grads = vjp((dy, dh_last))
  with jax.enable_x64(True):
    ref = lambda x, gx, ga, p, h0: reference.rg_lru_reference(x, gx, ga, p, reset, h0)
    (y_ref, h_ref), ref_vjp = jax.vjp(ref, *map(f64, args))
    ref_grads = ref_vjp((f64(dy), f64(dh_last)))
  tol = TOLERANCE[dtype]
  assert rel_err(y, y_ref) < tol and rel_err(h_last, h_ref) < h_tol
  for name, g, g_ref in zip(("dx", "d_gate_x", "d_gate_a", "d_a_param", "dh0"), grads,
                            ref_grads):
    assert rel_err(g, g_ref) < tol, name
  return y, h_last


@pytest.mark.parametrize("shape,dtype,config", [
    ((2, 100, 130), jnp.float32, None),           # the public entry (TPU interpret mode)
    ((2, 37, 200), jnp.bfloat16, TPU_SMALL_BLOCKS),
    ((3, 41, 100), jnp.float32, GPU_INTERPRET),
])
def test_rg_lru_fused_matches_unfused_layer(shape, dtype, config):
  args, reset, dy = layer_inputs(sum(shape), shape, dtype)
  if config is None:
    fused = lambda x, gx, ga, p, h0: pallas_kernels.rg_lru(x, gx, ga, p, reset, h0)
  else:
    fused = lambda x, gx, ga, p, h0: rg_lru_with_config(
        x, gx, ga, p, reset.astype(jnp.float32), h0, config)
  y, h_last = assert_layer_matches_float64(fused, args, reset, dy, dtype, seed=0,
                                           h_tol=TOLERANCE[dtype])
  assert y.dtype == dtype and h_last.dtype == jnp.float32


def test_rg_lru_reset_cuts_the_state():
  """With a reset at t, y from t on does not depend on anything before t (nor on h0)."""
  (x, gate_x, gate_a, a_param, h0), _, _ = layer_inputs(5, (1, 24, 16), jnp.float32)
  reset = jnp.zeros((1, 24), bool).at[0, 10].set(True)
  y1, _ = pallas_kernels.rg_lru(x, gate_x, gate_a, a_param, reset, h0)
  x2 = x.at[:, :10].set(jax.random.normal(jax.random.PRNGKey(9), (1, 10, 16)))
  y2, _ = pallas_kernels.rg_lru(x2, gate_x, gate_a, a_param, reset, -h0)
  np.testing.assert_array_equal(y1[:, 10:], y2[:, 10:])
  assert not np.allclose(y1[:, :10], y2[:, :10])


@pytest.mark.parametrize("shape,dtype", [((2, 44, 200), jnp.float32), ((3, 36, 256), jnp.bfloat16)])
def test_rg_lru_fused_with_the_mosaic_gpu_forward(shape, dtype, monkeypatch):
  # The fused layer's forward through gpu_mosaic.mosaic_scan (its interpreter: a short last
  # time tile, a partial channel block, resets), the Triton backward (Pallas' interpreter):
  # values and gradients against float64.
  from pallas_kernels.rg_lru import fused
  monkeypatch.setattr(fused, "MOSAIC_FORWARD", True)
  monkeypatch.setattr(fused, "MOSAIC_MIN_BLOCKS", 1)
  config = blocked.ScanConfig(backend="gpu", interpret=True, gpu_block_d=64, gpu_chunk=4,
                              gpu_forward="mosaic")
  called = []
  real = gpu_mosaic.mosaic_scan
  monkeypatch.setattr(gpu_mosaic, "mosaic_scan", lambda *a, **k: called.append(1) or real(*a, **k))
  args, reset, dy = layer_inputs(sum(shape), shape, dtype)
  fwd = lambda x, gx, ga, p, h0: rg_lru_with_config(x, gx, ga, p, reset.astype(jnp.float32), h0,
                                                    config)
  assert_layer_matches_float64(fwd, args, reset, dy, dtype, seed=1)
  assert called


@pytest.mark.parametrize("shape,dtype,chunks,forward", [
    ((2, 48, 64), jnp.float32, 4, "triton"),     # runs of 12: resets inside and at the edges
    ((3, 64, 128), jnp.bfloat16, 2, "mosaic"),   # the Mosaic forward's interpreter on the runs
])
def test_rg_lru_in_time_chunks_matches_float64(shape, dtype, chunks, forward, monkeypatch):
  # The chunked schedule (fused.rg_lru_chunked): values, h_last and every gradient, for a
  # cotangent of h_last too, against the one long float64 scan.
  from pallas_kernels.rg_lru import fused
  monkeypatch.setattr(fused, "MOSAIC_MIN_BLOCKS", 1)
  config = blocked.ScanConfig(backend="gpu", interpret=True, gpu_block_d=64, gpu_chunk=4,
                              gpu_forward=forward)
  args, reset, dy = layer_inputs(sum(shape) + chunks, shape, dtype)
  reset = reset.at[:, shape[1] // chunks].set(True)  # a document starting at a run's first row
  fwd = lambda x, gx, ga, p, h0: fused.rg_lru_chunked(x, gx, ga, p, reset.astype(jnp.float32),
                                                      h0, config, chunks)
  assert_layer_matches_float64(fwd, args, reset, dy, dtype, seed=2)


def test_the_mosaic_forward_runs_where_the_batch_gives_a_block_per_sm():
  from pallas_kernels.rg_lru import fused
  assert fused.mosaic_forward_has_blocks(16, 2048)    # Griffin 400M: 256 blocks
  assert fused.mosaic_forward_has_blocks(8, 2560)     # Griffin 1.3B's micro-batch: 160 blocks
  assert not fused.mosaic_forward_has_blocks(4, 2048)  # 64 blocks: the Triton forward is faster
  assert not fused.mosaic_forward_has_blocks(1, 2560)


def test_time_chunks_fill_the_gpu_only_where_the_batch_does_not():
  from pallas_kernels.rg_lru import fused
  assert fused.time_chunks(4, 8192, 2048) == 4      # Griffin 400M at T=8192: 4 x 16 blocks
  assert fused.time_chunks(16, 2048, 2048) == 1     # at T=2048 the batch fills 256 blocks
  # Griffin 1.3B's 8-row micro-batches: 160 programs of 128 channels, short of the chunked
  # schedule's 256 blocks, enough for the unchunked kernels (faster there).
  assert fused.time_chunks(8, 2048, 2560) == 1
  assert fused.time_chunks(4, 2048, 2560) == 4      # 80 programs: chunked to 4 x 4 x 20 blocks
  assert fused.time_chunks(1, 4096, 2560) == 16     # runs of 256 (MIN_CHUNK_T)
  assert fused.time_chunks(1, 300, 2560) == 1       # 300 has no runs of 256 that divide it


def test_rg_lru_fused_lowers_for_a_gpu(monkeypatch):
  # The GPU kernels lower for CUDA on this CPU machine (no GPU needed): the Mosaic GPU
  # forward where the batch gives enough blocks, the Triton forward where it does not, the
  # Triton backward in both; and the Mosaic kernel is refused for per-token rows of an
  # unaligned T.
  from pallas_kernels.rg_lru import fused
  monkeypatch.setattr(fused, "MOSAIC_FORWARD", True)
  for batch in (2, 16):
    x = jnp.zeros((batch, 64, 2048), jnp.bfloat16)
    reset, h0 = jnp.zeros((batch, 64)), jnp.zeros((batch, 2048))
    config = blocked.ScanConfig(backend="gpu", gpu_forward="mosaic",
                                **fused.gpu_block(batch, 2048))
    def loss(x, p):
      return jnp.sum(rg_lru_with_config(x, x, x, p, reset, h0, config)[0].astype(jnp.float32))
    text = helpers.lower_for_cuda(jax.grad(loss, argnums=(0, 1)), x, jnp.zeros((2048,)))
    assert ("custom_call @mosaic_gpu" in text) == (batch == 16), batch
    assert "@__gpu$xla.gpu.triton" in text
  assert not gpu_mosaic.supports(x, token_rows=(jnp.zeros((16, 62)),))
  # The time-chunked schedule of 4 long rows: the chunk passes (Triton) and the Mosaic forward
  # on the 16 runs.
  x, reset, h0 = jnp.zeros((4, 1024, 2048), jnp.bfloat16), jnp.zeros((4, 1024)), h0[:4]
  config = blocked.ScanConfig(backend="gpu", gpu_forward="mosaic", **fused.gpu_block(16, 2048))
  def chunked_loss(x, p):
    return jnp.sum(fused.rg_lru_chunked(x, x, x, p, reset, h0, config, 4)[0].astype(jnp.float32))
  text = helpers.lower_for_cuda(jax.grad(chunked_loss, argnums=(0, 1)), x, jnp.zeros((2048,)))
  assert "custom_call @mosaic_gpu" in text and text.count("@__gpu$xla.gpu.triton") >= 3
