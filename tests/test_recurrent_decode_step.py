"""The recurrent block's decoding kernel (``pallas_kernels.rg_lru.decode``: both gates and the
RG-LRU update for one token) against a float64 NumPy reference, and the model's decoding with
it against the XLA step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rg_lru import decode
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import sampling
from test_model import perturbed, tiny_config


def reference_update(x, seg, w_x, w_a, b_x, b_a, a_param, h0, dtype):
  """The step in float64 from the equations: the block-diagonal gates, the RG-LRU's decay and
  normalised input, ``h = a h0 + x_in``; the gate logits and the normalised input rounded to
  ``dtype`` where the model stores them in it."""
  f = lambda a: np.asarray(a, np.float64)
  rnd = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dtype).astype(jnp.float32),
                             np.float64)
  x, h0 = f(x), f(h0)
  blocks = x.reshape(x.shape[0], w_x.shape[0], -1)
  logits = lambda w, b: rnd(np.einsum("bhi,hij->bhj", blocks, f(w)) + f(b)).reshape(x.shape)
  gate_x = 1 / (1 + np.exp(-logits(w_x, b_x)))
  gate_a = 1 / (1 + np.exp(-logits(w_a, b_a)))
  log_a = -8.0 * gate_a * np.logaddexp(f(a_param), 0.0)
  reset = np.asarray(seg)[:, None] == 0
  multiplier = np.where(reset, 1.0, np.sqrt(1 - np.exp(2 * log_a)))
  return np.where(reset, 0.0, np.exp(log_a)) * h0 + rnd(x * gate_x * multiplier)


def random_inputs(seed, batch, width, blocks, dtype):
  rng = np.random.default_rng(seed)
  block = width // blocks
  arr = lambda shape, scale=1.0, dt=dtype: jnp.asarray(rng.normal(size=shape) * scale, dt)
  seg = rng.choice([0, 1, 2, 50], size=batch).astype(np.int32)
  seg[0] = 0  # a document start
  return (arr((batch, width)), jnp.asarray(seg),
          arr((blocks, block, block), block ** -0.5), arr((blocks, block, block), block ** -0.5),
          arr((blocks, block), 0.1, jnp.float32), arr((blocks, block), 0.1, jnp.float32),
          arr((width,), 1.0, jnp.float32), arr((batch, width), 1.0, jnp.float32))


@pytest.mark.parametrize("batch,width,blocks,dtype,split", [
    (5, 96, 2, jnp.float32, 32),      # blocks of 48 (no multiple of 32): pieces 32 + 16, unrolled
    (70, 64, 4, jnp.bfloat16, 32),    # blocks of 16, two row tiles
    (3, 320, 2, jnp.float32, 32),     # blocks of 160 as 5 programs of 32 columns
    (70, 320, 2, jnp.float32, 32),    # the same over two row tiles, padded rows
    (3, 320, 2, jnp.float32, 0),      # whole blocks of 160: pieces of 128 + 32, unrolled
    (33, 256, 2, jnp.bfloat16, 32),   # blocks of 128 as 4 programs
    (5, 256, 2, jnp.bfloat16, 64),    # as 2 programs of 64 columns
])
def test_gates_update_matches_float64(batch, width, blocks, dtype, split, monkeypatch):
  monkeypatch.setattr(decode, "_SPLIT", split)
  jax.clear_caches()  # _SPLIT is read when tracing
  inputs = random_inputs(batch * width + split, batch, width, blocks, dtype)
  y, h = decode.gates_update(*inputs, interpret=True)
  want = reference_update(*inputs, dtype)
  assert y.dtype == dtype and h.dtype == jnp.float32 and h.shape == (batch, width)
  # float32: to rounding; bfloat16: a logit or the normalised input one rounding apart
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(h), want, rtol=tol, atol=tol)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(h.astype(dtype)))
  # with the other branch (linear_y's output): y times its GeLU, the state unchanged
  gate = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, width)) * 2, dtype)
  y_gated, h_gated = decode.gates_update(*inputs, gate=gate, interpret=True)
  np.testing.assert_array_equal(np.asarray(h_gated), np.asarray(h))
  g = np.asarray(gate, np.float64)
  gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
  want_y = np.asarray(h.astype(dtype), np.float64) * gelu
  np.testing.assert_allclose(np.asarray(y_gated, np.float64), want_y, rtol=2 * tol, atol=2 * tol)
  # the pure-JAX reference (check_gpu_kernels.py's) in float64 agrees with this one without
  # the roundings
  with jax.enable_x64(True):
    wide = [np.asarray(a, np.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a
            for a in inputs]
    np.testing.assert_allclose(np.asarray(decode.reference(*wide)[1]),
                               reference_update(*wide, jnp.float32), rtol=1e-6, atol=1e-6)
  jax.clear_caches()  # no trace made with this _SPLIT outlives the test


def test_gates_update_rejects_mismatched_shapes():
  inputs = list(random_inputs(0, 4, 64, 2, jnp.float32))
  inputs[3] = inputs[3][:1]  # one decay-gate block for two input-gate blocks
  with pytest.raises(ValueError, match="gate blocks"):
    decode.gates_update(*inputs, interpret=True)


@pytest.mark.parametrize("family", ["hawk", "griffin"])
def test_sampling_with_the_decode_kernel_equals_the_xla_step(family, monkeypatch):
  """Greedy decoding through ``model.decode_impl=pallas`` and ``mlp_impl=pallas`` (the
  recurrent step's kernel and ``gated_up``, interpreted) gives the XLA step's logits (float32:
  to rounding) and tokens, resets and prompts of two lengths included; under the kernels'
  ``MIN_ROWS`` rows both keep XLA's path."""
  from pallas_kernels.mlp import gated_up  # pylint: disable=g-import-not-at-top
  calls, mlp_calls = [], []
  kernel, mlp_kernel = decode.gates_update, gated_up.gated_up
  monkeypatch.setattr(decode, "gates_update", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  monkeypatch.setattr(gated_up, "gated_up",
                      lambda *a, **k: mlp_calls.append(1) or mlp_kernel(*a, **k))
  results = {}
  for impl, min_rows in (("xla", 1), ("pallas", 2), ("pallas", 3)):  # 2 rows: kernel, kernel, XLA
    monkeypatch.setattr(gated_up, "MIN_ROWS", min_rows)
    monkeypatch.setattr(decode, "MIN_ROWS", min_rows)
    jax.clear_caches()  # MIN_ROWS is read when tracing; the same config's trace is cached
    calls.clear()
    mlp_calls.clear()
    cfg = tiny_config(family=family, num_layers=3, attention_window_size=4, decode_impl=impl,
                      mlp_impl=impl, width=64, mlp_expanded_width=128)
    model = perturbed(model_lib.init_model(cfg, seed=5), seed=6, scale=0.1)
    out = sampling.sample(model, [[1, 2, 3, 4, 5], [6, 7]],
                          sampling.SamplingParams(max_new_tokens=6), return_logits=True)
    results[impl, min_rows] = out
    # traced once per recurrent block, and only for the kernel
    assert len(calls) == (cfg.resolved_block_types.count("recurrent")
                          if (impl, min_rows) == ("pallas", 2) else 0)
    assert len(mlp_calls) == (cfg.num_layers if (impl, min_rows) == ("pallas", 2) else 0)
  for key in (("pallas", 2), ("pallas", 3)):
    np.testing.assert_allclose(results[key].logits, results["xla", 1].logits, rtol=2e-5,
                               atol=2e-5)
    np.testing.assert_array_equal(results[key].tokens, results["xla", 1].tokens)
  assert model_lib.ModelConfig(decode_impl="auto").resolved_decode_impl == "xla"  # on a CPU
  assert model_lib.ModelConfig(decode_impl="triton").errors() == [
      "model.decode_impl='triton' is not one of auto|xla|pallas"]


@pytest.mark.parametrize("width,blocks", [(2560, 16), (2048, 8)])  # Hawk 1.3B's 160s; 256s
def test_gates_update_lowers_for_a_gpu(width, blocks):
  """The kernel lowers to Triton for CUDA on this CPU machine (no GPU needed)."""
  import helpers  # pylint: disable=g-import-not-at-top
  inputs = random_inputs(0, 64, width, blocks, jnp.bfloat16)
  text = helpers.lower_for_cuda(decode.gates_update, *inputs)
  assert text.count("@__gpu$xla.gpu.triton") == 1 and "pallas_recurrent_gates_update" in text
  if width == 2048:  # and the MLP's up-projection and gating at Hawk 1.3B's [2048, 2, 6144]
    from pallas_kernels.mlp import gated_up  # pylint: disable=g-import-not-at-top
    for dtype in (jnp.bfloat16, jnp.float32):
      text = helpers.lower_for_cuda(
          gated_up.gated_up, jax.ShapeDtypeStruct((2048, 2048), dtype),
          jax.ShapeDtypeStruct((2, 2048, 6144), dtype),
          jax.ShapeDtypeStruct((2, 6144), jnp.float32))
      assert text.count("@__gpu$xla.gpu.triton") == 1 and "pallas_gated_up" in text
    # the Mosaic GPU kernel, in clusters of two CTAs (covered only here and on the GPU: the
    # interpreter has no cluster barriers)
    text = helpers.lower_for_cuda(
        lambda x, w, b: gated_up.gated_up(x, w, b, impl="mosaic"),
        jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 2048, 6144), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 6144), jnp.float32))
    assert text.count("custom_call @mosaic_gpu") == 1 and "@__gpu$xla.gpu.triton" not in text
    assert gated_up.MOSAIC_CLUSTER == 2 and "cluster.wait" in text


@pytest.mark.parametrize("n,d,m,dtype,impl", [
    (5, 128, 192, jnp.float32, "triton"),    # 64 columns a tile (192: no multiple of 128), K 32
    (130, 64, 64, jnp.bfloat16, "triton"),   # two row tiles, the second padded
    (20, 64, 256, jnp.bfloat16, "triton"),   # 128 columns a tile, 32 rows
    (130, 64, 128, jnp.bfloat16, "mosaic"),  # two row tiles, the second padded
    (300, 128, 256, jnp.bfloat16, "mosaic"),  # 6 tiles over 3 CTAs: two a CTA; two K steps
    (20, 64, 128, jnp.float16, "mosaic"),
])
def test_gated_up_matches_float64(n, d, m, dtype, impl):
  """pallas_kernels.mlp.gated_up (decoding's up-projection and GeLU gating in one kernel), the
  Triton and the Mosaic GPU kernel in their interpreters, against float64, padded rows
  included; a shape or dtype a kernel does not take is refused by name."""
  from pallas_kernels.mlp import gated_up  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(n + d + m)
  x = jnp.asarray(rng.normal(size=(n, d)), dtype)
  w = jnp.asarray(rng.normal(size=(2, d, m)) / np.sqrt(d), jnp.float32)
  b = jnp.asarray(rng.normal(size=(2, m)) * 0.1, jnp.float32)
  got = np.asarray(gated_up.gated_up(x, w, b, impl=impl, interpret=True), np.float64)
  up = np.einsum("nd,cdm->cnm", np.asarray(x, np.float64), np.asarray(w.astype(dtype), np.float64))
  up += np.asarray(b, np.float64)[:, None]
  gelu = 0.5 * up[0] * (1 + np.tanh(np.sqrt(2 / np.pi) * (up[0] + 0.044715 * up[0] ** 3)))
  want = gelu * up[1]
  # bfloat16 and float16: the branches' and the GeLU's roundings
  tol = {jnp.float32: 1e-5, jnp.float16: 4e-3, jnp.bfloat16: 2e-2}[dtype]
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
  with pytest.raises(ValueError, match="gated_up"):
    gated_up.gated_up(x[:, :d - 1], w[:, :d - 1], b, impl=impl, interpret=True)
  if impl == "mosaic":
    with pytest.raises(ValueError, match="Mosaic GPU kernel does not take dtype float32"):
      gated_up.gated_up(x.astype(jnp.float32), w, b, impl=impl, interpret=True)


def test_gated_up_path(monkeypatch):
  """auto: Triton's interpreter on a CPU, Mosaic on Hopper GPUs only; shapes and dtypes the
  Mosaic kernel cannot take go to Triton even when asked for; a bad setting is named."""
  import helpers  # pylint: disable=g-import-not-at-top
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  ok = (2048, 6144, jnp.bfloat16)
  helpers.assert_mosaic_on_hopper(monkeypatch, dispatch.gated_up_path, *ok)
  monkeypatch.setattr(dispatch, "GATED_UP_IMPL", "mosaic")
  assert dispatch.gated_up_path(*ok) == "mosaic"
  for unsupported in ((2048, 6144, jnp.float32), (2048, 6208, jnp.bfloat16),
                      (2080, 6144, jnp.bfloat16)):
    assert dispatch.gated_up_path(*unsupported) == "triton"
  monkeypatch.setattr(dispatch, "GATED_UP_IMPL", "triton")
  assert dispatch.gated_up_path(*ok) == "triton"
  monkeypatch.setattr(dispatch, "GATED_UP_IMPL", "cutlass")
  with pytest.raises(ValueError, match="GATED_UP_IMPL='cutlass': allowed auto"):
    dispatch.gated_up_path(*ok)


def test_decode_kernel_benchmark_script_prints_its_rows():
  """scripts/bench/bench_decode_kernels.py --tiny (interpreted): XLA's rows and the kernels'."""
  import helpers  # pylint: disable=g-import-not-at-top
  out = helpers.run_script("bench/bench_decode_kernels.py", "--tiny").stdout
  rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
  names = [r.split(" | ")[1] for r in rows]
  assert names[:8] == [
      "XLA", "XLA", "kernel, 32 rows x 4 warps x 32 columns a program",
      "XLA's Conv1D, then the kernel, 32 rows x 4 warps x 32 columns a program", "XLA",
      "kernel, tile 64x64, K 64, 4 warps, 2 stages",
      "Mosaic GPU kernel, 2 stages, clusters of 1", "XLA"], out
  # the greedy kernels' rows, with the fraction of rows on which each picks XLA's token
  assert names[8].startswith("kernel, tile 16x256, K 64, 4 warps, 2 stages (same token on "), out
  assert names[9].startswith("Mosaic GPU kernel, 2 stages, clusters of 1 (same token on "), out
  # decode attention: ragged and full global caches, then a local ring, each against its kernel
  works = [r.split(" | ")[0].lstrip("| ") for r in rows[10:]]
  mosaic = "Mosaic GPU, 64 keys a slot, 2 slots"
  assert names[10:] == ["Triton (JAX's decode_attention)", mosaic] * 2 + [
      "XLA over the 101-slot ring", mosaic], out
  assert works == (["decode attention, 3 rows x 128 slots, ragged"] * 2
                   + ["decode attention, 3 rows x 128 slots, full"] * 2
                   + ["local attention, 5 rows, window 100"] * 2), out
