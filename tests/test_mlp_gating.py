"""The gated MLP's GeLU gating with the Triton backward (pallas_kernels.mlp) against float64,
forward and backward, in Pallas' interpreter on the CPU; and a model using it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from pallas_kernels.mlp import gating as kernel
from recurrentgemma_jax import model as model_lib


def reference(up, bias, dh):  # float64 NumPy: h and the gradients of sum(h * dh)
  up, bias, dh = (np.asarray(a, np.float64) for a in (up, bias, dh))
  g, u = up[..., 0, :] + bias[0], up[..., 1, :] + bias[1]
  c = np.sqrt(2 / np.pi)
  t = np.tanh(c * (g + 0.044715 * g**3))
  gelu = 0.5 * g * (1 + t)
  d_gelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * 0.044715 * g * g)
  dg, du = dh * u * d_gelu, dh * gelu
  lead = tuple(range(dg.ndim - 1))
  return gelu * u, np.stack([dg, du], axis=-2), np.stack([dg.sum(lead), du.sum(lead)])


@pytest.mark.parametrize("lead,m,dtype,tol", [
    ((2, 64), 128, jnp.float32, 1e-5),     # whole tiles
    ((3, 37), 48, jnp.float32, 1e-5),      # rows padded to the 64-row tile, 16-column tiles
    ((1, 1), 32, jnp.float32, 1e-5),       # one row
    ((2, 50), 80, jnp.bfloat16, 1e-2),
    ((5, 7), 20, jnp.float32, 1e-5),       # M not a multiple of 16: the jnp backward
])
def test_gated_gelu_matches_float64(lead, m, dtype, tol):
  ku, kb, kd = jax.random.split(jax.random.PRNGKey(m + sum(lead)), 3)
  up = (2 * jax.random.normal(ku, (*lead, 2, m))).astype(dtype)
  bias = (0.5 * jax.random.normal(kb, (2, m))).astype(dtype)
  dh = jax.random.normal(kd, (*lead, m)).astype(dtype)
  assert kernel.supported(m) == (m % 16 == 0)
  want_h, want_dup, want_db = reference(up, bias, dh)

  h = kernel.gated_gelu(up, bias, interpret=True)
  assert h.dtype == dtype and h.shape == (*lead, m)
  np.testing.assert_allclose(np.asarray(h, np.float64), want_h, rtol=tol,
                             atol=tol * np.abs(want_h).max())
  dup, db = jax.grad(lambda up, bias: jnp.sum(
      kernel.gated_gelu(up, bias, interpret=True).astype(jnp.float32)
      * dh.astype(jnp.float32)), (0, 1))(up, bias)
  assert dup.dtype == dtype and db.dtype == dtype
  for got, want in ((dup, want_dup), (db, want_db)):
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < tol, err


def test_gated_gelu_rejects_a_wrong_layout():
  with pytest.raises(ValueError, match=r"up \[..., 2, M\] and bias \[2, M\]"):
    kernel.gated_gelu(jnp.zeros((4, 3, 16)), jnp.zeros((3, 16)))


def test_mqa_with_the_mlp_kernel_equals_xla_autodiff():
  cfg = model_lib.ModelConfig(family="mqa", vocab_size=41, width=32, num_layers=2, num_heads=2,
                              mlp_expanded_width=48, dtype="float32")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 41)
  pos = jnp.stack([jnp.arange(11), jnp.concatenate([jnp.arange(4), jnp.arange(7)])])

  (l_xla, g_xla, k_xla), (l_kernel, g_kernel, k_kernel) = helpers.xla_and_kernel_runs(
      cfg, "mlp_impl", tokens, pos)
  # The kernel runs (one per layer, in the backward) only where asked for.
  assert (k_xla, k_kernel) == (0, 2)
  np.testing.assert_allclose(l_kernel, l_xla, rtol=1e-6)
  helpers.assert_grads_close(g_kernel, g_xla)
  assert cfg.resolved_mlp_impl == "xla"  # auto: the kernel only on GPUs
  assert dataclasses.replace(cfg, mlp_impl="triton").errors() == [
      "model.mlp_impl='triton' is not one of auto|xla|pallas"]


def test_gating_backward_lowers_for_a_gpu():
  # The Triton kernel lowers for CUDA on this CPU machine (no GPU needed), at MQA-400M's width
  # and with rows that pad the last tile.
  for n in (4096, 70):
    up = jax.ShapeDtypeStruct((n, 2, 4608), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((2, 4608), jnp.bfloat16)
    dh = jax.ShapeDtypeStruct((n, 4608), jnp.bfloat16)

    def fwd_bwd(up, bias, dh):
      h, vjp = jax.vjp(kernel.gated_gelu, up, bias)
      return h, vjp(dh)
    text = helpers.lower_for_cuda(fwd_bwd, up, bias, dh)
    assert text.count("@__gpu$xla.gpu.triton") == 1, n


def test_on_a_tpu_target_the_pallas_setting_takes_xla(monkeypatch):
  # The kernel is Triton: compiled for a TPU, mlp_impl=pallas must take XLA's gating, not run
  # the Triton kernel in Pallas' interpreter inside a TPU program.
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  cfg = model_lib.ModelConfig(family="mqa", vocab_size=41, width=32, num_layers=1, num_heads=2,
                              mlp_expanded_width=48, dtype="float32", attention_impl="xla",
                              norm_impl="xla", mlp_impl="xla")
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, 41)
  pos = jnp.tile(jnp.arange(9), (2, 1))
  want, _ = helpers.loss_grads_and_kernels(cfg, tokens, pos)[:2]
  monkeypatch.setattr(dispatch, "target_platform", lambda: "tpu")
  monkeypatch.setattr(model_lib.mlp_kernels, "gated_gelu",
                      lambda *a, **k: pytest.fail("the Triton gating on a TPU target"))
  got, _, kernels = helpers.loss_grads_and_kernels(
      dataclasses.replace(cfg, mlp_impl="pallas"), tokens, pos)
  assert kernels == 0
  np.testing.assert_allclose(got, want, rtol=1e-6)
