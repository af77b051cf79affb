"""The RMSNorm with the Triton backward (pallas_kernels.norm) against float64, values and
gradients (with and without a bias), in Pallas' interpreter on the CPU; and models using it
against XLA's autodiff."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from flax import nnx
from pallas_kernels.norm import rms as kernel
from recurrentgemma_jax import layers
from recurrentgemma_jax import model as model_lib

EPS = 1e-6


def reference(x, scale, ds, dn, bias=None):
  """float64 NumPy: the stream s = x + bias, its normalisation, and the gradients of
  sum(s * ds) + sum(n * dn): x's (and so the bias's, its column sum) and the scale's."""
  x, scale, ds, dn = (np.asarray(a, np.float64) for a in (x, scale, ds, dn))
  s = x if bias is None else x + np.asarray(bias, np.float64)
  r = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
  g = dn * (1.0 + scale)
  dx = ds + r * g - s * r**3 * np.mean(g * s, axis=-1, keepdims=True)
  dscale = (dn * s * r).reshape(-1, s.shape[-1]).sum(0)
  return s, s * r * (1.0 + scale), dx, dscale, dx.reshape(-1, s.shape[-1]).sum(0)


def _inputs(lead, d, dtype):
  kx, ks, kd, kn, kb = jax.random.split(jax.random.PRNGKey(d + sum(lead)), 5)
  x = (3 * jax.random.normal(kx, (*lead, d)) + 0.5).astype(dtype)
  scale = 0.3 * jax.random.normal(ks, (d,))  # float32, as the model's parameters
  bias = jax.random.normal(kb, (d,))
  ds = jax.random.normal(kd, (*lead, d)).astype(dtype)
  dn = jax.random.normal(kn, (*lead, d)).astype(dtype)
  return x, scale, bias, ds, dn


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("lead,d,dtype,tol", [
    ((2, 32), 256, jnp.float32, 1e-5),    # whole 32-row programs, one 256-column chunk
    ((3, 37), 48, jnp.float32, 1e-5),     # rows past the last program masked; 3 chunks of 16
    ((1,), 96, jnp.float32, 1e-5),        # one row; 3 chunks of 32 (D not a power of 2)
    ((2, 50), 80, jnp.bfloat16, 1e-2),
    ((5, 7), 20, jnp.float32, 1e-5),      # D not a multiple of 16: the jnp backward
])
def test_rms_norm_with_skip_matches_float64(lead, d, dtype, tol, with_bias):
  x, scale, bias, ds, dn = _inputs(lead, d, dtype)
  bias = bias if with_bias else None
  assert kernel.supported(d) == (d % 16 == 0)
  # The bias as the kernel adds it: rounded to x's dtype.
  want = reference(x, scale, ds, dn, None if bias is None else bias.astype(dtype))
  want_s, want_n, want_dx, want_dscale, want_dbias = want

  skip, n = kernel.rms_norm_with_skip(x, scale, eps=EPS, bias=bias, interpret=True)
  if bias is None:
    assert skip is x or np.array_equal(np.asarray(skip), np.asarray(x))
  assert skip.dtype == n.dtype == dtype and skip.shape == n.shape == x.shape
  for got, expected in ((skip, want_s), (n, want_n)):
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=tol, atol=tol)

  def loss(x, scale, bias):
    skip, n = kernel.rms_norm_with_skip(x, scale, eps=EPS, bias=bias, interpret=True)
    f32 = jnp.float32
    return jnp.sum(skip.astype(f32) * ds.astype(f32)) + jnp.sum(n.astype(f32) * dn.astype(f32))

  dx, dscale, dbias = jax.grad(loss, (0, 1, 2))(x, scale, bias)
  assert dx.dtype == dtype and dscale.dtype == jnp.float32
  pairs = [(dx, want_dx), (dscale, want_dscale)]
  if bias is None:
    assert dbias is None
  else:
    assert dbias.dtype == jnp.float32 and dbias.shape == (d,)
    pairs.append((dbias, want_dbias))
  for got, expected in pairs:
    err = np.linalg.norm(np.asarray(got, np.float64) - expected) / np.linalg.norm(expected)
    assert err < tol, err


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_jnp_backward_gives_the_kernels_values(dtype):
  # backward_reference is the path of widths the kernel does not take: on one it does take,
  # the two agree (float32 sums in another order; bfloat16 dx within one rounding).
  s, scale, _, ds, dn = _inputs((3, 37), 48, dtype)
  s = s.reshape(-1, 48)
  ds, dn = ds.reshape(s.shape), dn.reshape(s.shape)
  got = kernel._backward_kernel(s, scale, ds, dn, EPS, True)
  want = kernel.backward_reference(s, scale, ds, dn, EPS)
  assert [a.dtype for a in got] == [a.dtype for a in want] == [dtype, jnp.float32, jnp.float32]
  rtol = 1e-5 if dtype == jnp.float32 else 1e-2
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol,
                               atol=rtol)


def test_rms_norm_with_skip_rejects_wrong_shapes():
  with pytest.raises(ValueError, match=r"x \[..., D\], scale \[D\] and bias \[D\] or None"):
    kernel.rms_norm_with_skip(jnp.zeros((4, 16)), jnp.zeros((8,)), eps=EPS)
  with pytest.raises(ValueError, match=r"got \(4, 16\), \(16,\) and \(8,\)"):
    kernel.rms_norm_with_skip(jnp.zeros((4, 16)), jnp.zeros((16,)), eps=EPS, bias=jnp.zeros(8))


def test_the_layer_gives_the_same_values_on_both_paths():
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 32), jnp.bfloat16)
  bias = jnp.linspace(-1.0, 2.0, 32)
  norms = [layers.RMSNorm(32, impl=impl) for impl in ("xla", "pallas")]
  for norm in norms:
    norm.scale.value = jnp.linspace(-0.5, 0.5, 32)
  assert [norm.runs_kernel(x) for norm in norms] == [False, True]
  (sx, nx), (sp, n_p) = (norm.with_skip(x) for norm in norms)
  np.testing.assert_array_equal(np.asarray(sx), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(sp), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(n_p), np.asarray(nx))
  np.testing.assert_array_equal(np.asarray(nx), np.asarray(norms[0](x)))
  # With a bias: the stream x + bias (in x's dtype) on both paths, and the same gradients.
  (sx, nx), (sp, n_p) = (norm.with_skip(x, bias) for norm in norms)
  want = x + bias.astype(x.dtype)
  for got in (sx, sp):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(n_p), np.asarray(nx))

  def grads(norm):
    graphdef, params = nnx.split(norm)
    def loss(params, x, bias):
      s, n = nnx.merge(graphdef, params).with_skip(x, bias)
      return jnp.sum(jnp.sin(s.astype(jnp.float32))) + jnp.sum(n.astype(jnp.float32) ** 2)
    return jax.grad(loss, (0, 1, 2))(params, x, bias)
  g_xla, g_kernel = (grads(norm) for norm in norms)
  assert np.abs(g_kernel[2]).min() > 0.1
  helpers.assert_grads_close(g_kernel, g_xla, rtol=2e-2, atol=2e-2)


def _model_config(family, **overrides):
  cfg = model_lib.ModelConfig(family=family, vocab_size=41, width=32, lru_width=48,
                              num_layers=3, num_heads=2, num_gate_blocks=2,
                              mlp_expanded_width=48, attention_window_size=4, dtype="float32",
                              fused_rg_lru="false", conv1d_impl="xla", mlp_impl="xla")
  return dataclasses.replace(cfg, **overrides)


@pytest.mark.parametrize("family,overrides", [
    ("griffin", {}), ("mqa", {}), ("gla", {}),
    # Layers as one scan (a zero bias enters its carry) and a tail layer after it.
    ("griffin", dict(num_layers=4, scan_layers="true")),
])
def test_a_model_with_the_norm_kernel_equals_xla_autodiff(family, overrides, monkeypatch):
  cfg = _model_config(family, **overrides)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 41)
  pos = jnp.stack([jnp.arange(11), jnp.concatenate([jnp.arange(4), jnp.arange(7)])])

  (l_xla, g_xla, k_xla), (l_kernel, g_kernel, k_kernel) = helpers.xla_and_kernel_runs(
      cfg, "norm_impl", tokens, pos, biases=0.5)
  # Two norms a layer, each one kernel in the backward, only where asked for.
  assert (k_xla, k_kernel) == (0, 2 * cfg.num_layers)
  np.testing.assert_allclose(l_kernel, l_xla, rtol=1e-6)
  # (The bias is added after the branch's residual add: float32 rounding, grads up to ~10.)
  helpers.assert_grads_close(g_kernel, g_xla, atol=3e-5)

  # Every norm but the first takes the output bias of the branch before it (a scan's first
  # takes a zero bias: its carry); with a decoding cache, none does.
  biases = []
  norm = kernel.rms_norm_with_skip
  monkeypatch.setattr(kernel, "rms_norm_with_skip",
                      lambda *a, bias=None, **kw: biases.append(bias is not None) or norm(
                          *a, bias=bias, **kw))
  model = model_lib.Model(dataclasses.replace(cfg, norm_impl="pallas"), rngs=nnx.Rngs(0))
  model(tokens, pos)
  scanned = cfg.layers_scanned
  assert biases == [scanned] + [True] * (2 * cfg.num_layers - 1)
  biases.clear()
  model.extend(tokens, pos, model.init_cache(2, 16))
  assert biases == [False] * (2 * cfg.num_layers)
  assert cfg.resolved_norm_impl == "xla"  # auto: the kernel only on GPUs
  assert dataclasses.replace(cfg, norm_impl="triton").errors() == [
      "model.norm_impl='triton' is not one of auto|xla|pallas"]


def test_the_norm_backward_lowers_for_a_gpu():
  # The Triton kernel lowers for CUDA on this CPU machine (no GPU needed): Griffin 400M's
  # residual stream, with and without a bias, and a row count whose last program is masked.
  for n, with_bias in ((32768, True), (32768, False), (37, True)):
    x = jax.ShapeDtypeStruct((n, 1536), jnp.bfloat16)
    scale = jax.ShapeDtypeStruct((1536,), jnp.float32)

    def fwd_bwd(x, scale, bias, ds, dn, with_bias=with_bias):
      out, vjp = jax.vjp(lambda x, scale, bias: kernel.rms_norm_with_skip(
          x, scale, eps=EPS, bias=bias if with_bias else None), x, scale, bias)
      return out, vjp((ds, dn))
    text = jax.jit(fwd_bwd).trace(x, scale, scale, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("@__gpu$xla.gpu.triton") == 1, (n, with_bias)
