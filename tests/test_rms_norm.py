"""The RMSNorm with the Triton backward (pallas_kernels.norm) against float64, values and
gradients, in Pallas' interpreter on the CPU; and a model using it against XLA's autodiff."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from pallas_kernels.norm import rms as kernel
from recurrentgemma_jax import layers
from recurrentgemma_jax import model as model_lib

EPS = 1e-6


def reference(x, scale, ds, dn):
  """float64 NumPy: the normalisation, and the gradients of sum(x * ds) + sum(n * dn)."""
  x, scale, ds, dn = (np.asarray(a, np.float64) for a in (x, scale, ds, dn))
  r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
  g = dn * (1.0 + scale)
  dx = ds + r * g - x * r**3 * np.mean(g * x, axis=-1, keepdims=True)
  dscale = (dn * x * r).reshape(-1, x.shape[-1]).sum(0)
  return x * r * (1.0 + scale), dx, dscale


@pytest.mark.parametrize("lead,d,dtype,tol", [
    ((2, 32), 256, jnp.float32, 1e-5),    # whole 32-row programs, one 256-column chunk
    ((3, 37), 48, jnp.float32, 1e-5),     # rows past the last program masked; 3 chunks of 16
    ((1,), 96, jnp.float32, 1e-5),        # one row; 3 chunks of 32 (D not a power of 2)
    ((2, 50), 80, jnp.bfloat16, 1e-2),
    ((5, 7), 20, jnp.float32, 1e-5),      # D not a multiple of 16: the jnp backward
    ((19,), 2560, jnp.float32, 1e-5),     # 5 chunks of 512 (not a multiple of 1024)
])
def test_rms_norm_with_skip_matches_float64(lead, d, dtype, tol):
  kx, ks, kd, kn = jax.random.split(jax.random.PRNGKey(d + sum(lead)), 4)
  x = (3 * jax.random.normal(kx, (*lead, d)) + 0.5).astype(dtype)
  scale = 0.3 * jax.random.normal(ks, (d,))  # float32, as the model's parameter
  ds = jax.random.normal(kd, (*lead, d)).astype(dtype)
  dn = jax.random.normal(kn, (*lead, d)).astype(dtype)
  assert kernel.supported(d) == (d % 16 == 0)
  want_n, want_dx, want_dscale = reference(x, scale, ds, dn)

  skip, n = kernel.rms_norm_with_skip(x, scale, eps=EPS, interpret=True)
  assert skip is x or np.array_equal(np.asarray(skip), np.asarray(x))
  assert n.dtype == dtype and n.shape == x.shape
  np.testing.assert_allclose(np.asarray(n, np.float64), want_n, rtol=tol, atol=tol)

  def loss(x, scale):
    skip, n = kernel.rms_norm_with_skip(x, scale, eps=EPS, interpret=True)
    f32 = jnp.float32
    return jnp.sum(skip.astype(f32) * ds.astype(f32)) + jnp.sum(n.astype(f32) * dn.astype(f32))

  dx, dscale = jax.grad(loss, (0, 1))(x, scale)
  assert dx.dtype == dtype and dscale.dtype == jnp.float32
  for got, want in ((dx, want_dx), (dscale, want_dscale)):
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < tol, err


def test_rms_norm_with_skip_rejects_a_wrong_scale():
  with pytest.raises(ValueError, match=r"x \[..., D\] and scale \[D\]"):
    kernel.rms_norm_with_skip(jnp.zeros((4, 16)), jnp.zeros((8,)), eps=EPS)


def test_the_layer_gives_the_same_values_on_both_paths():
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 32), jnp.bfloat16)
  norms = [layers.RMSNorm(32, impl=impl) for impl in ("xla", "pallas")]
  for norm in norms:
    norm.scale.value = jnp.linspace(-0.5, 0.5, 32)
  (sx, nx), (sp, n_p) = (norm.with_skip(x) for norm in norms)
  np.testing.assert_array_equal(np.asarray(sx), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(sp), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(n_p), np.asarray(nx))
  np.testing.assert_array_equal(np.asarray(nx), np.asarray(norms[0](x)))


@pytest.mark.parametrize("family", ["griffin", "mqa"])
def test_a_model_with_the_norm_kernel_equals_xla_autodiff(family):
  cfg = model_lib.ModelConfig(family=family, vocab_size=41, width=32, lru_width=48,
                              num_layers=3, num_heads=2, num_gate_blocks=2,
                              mlp_expanded_width=48, attention_window_size=4, dtype="float32",
                              fused_rg_lru="false", conv1d_impl="xla", mlp_impl="xla")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 41)
  pos = jnp.stack([jnp.arange(11), jnp.concatenate([jnp.arange(4), jnp.arange(7)])])

  (l_xla, g_xla, k_xla), (l_kernel, g_kernel, k_kernel) = helpers.xla_and_kernel_runs(
      cfg, "norm_impl", tokens, pos)
  # Two norms a layer, each one kernel in the backward, only where asked for.
  assert (k_xla, k_kernel) == (0, 2 * cfg.num_layers)
  np.testing.assert_allclose(l_kernel, l_xla, rtol=1e-6)
  helpers.assert_grads_close(g_kernel, g_xla)
  assert cfg.resolved_norm_impl == "xla"  # auto: the kernel only on GPUs
  assert dataclasses.replace(cfg, norm_impl="triton").errors() == [
      "model.norm_impl='triton' is not one of auto|xla|pallas"]


@pytest.mark.parametrize("d,warps", [(1536, 2), (2048, 4), (2560, 2), (48, 1)])
def test_backward_lowers_for_a_gpu(d, warps):
  # The Triton backward lowers for CUDA on this CPU machine (no GPU needed) at the residual
  # widths of Griffin 400M (1536) and 1.3B (2048), at 2560 (5 chunks) and a tiny one, with 70
  # rows (the last program masked), each with the rule's warps (8 bfloat16 a thread, at least
  # one warp).
  x = jax.ShapeDtypeStruct((70, d), jnp.bfloat16)
  scale = jax.ShapeDtypeStruct((d,), jnp.float32)
  text = helpers.lower_for_cuda(
      lambda x, s, ds, dn: kernel._backward_kernel(x, s, ds, dn, EPS, False), x, scale, x, x)
  assert text.count("@__gpu$xla.gpu.triton") == 1
  assert f"num_warps = {warps} : i32" in text
