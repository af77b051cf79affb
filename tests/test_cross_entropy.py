"""The training loss's cross-entropy kernel (pallas_kernels.loss) against float64, values and
gradients, in Pallas' interpreter on the CPU; per device under a mesh; in a model's loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.loss import lse as kernel
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import train
from sharding import partitioning


def float64_losses_and_grad(logits, targets, weights):
  """NumPy float64: the losses, and the gradient of sum(losses * weights)."""
  x = np.asarray(logits, np.float64)
  top = x.max(-1, keepdims=True)
  lse = top[..., 0] + np.log(np.exp(x - top).sum(-1))
  onehot = np.arange(x.shape[-1]) == np.asarray(targets)[..., None]
  losses = lse - (x * onehot).sum(-1)
  grad = (np.exp(x - lse[..., None]) - onehot) * np.asarray(weights, np.float64)[..., None]
  return losses, grad


def inputs(seed, lead, vocab, dtype, offset):
  k = jax.random.split(jax.random.key(seed), 3)
  logits = (jax.random.normal(k[0], (*lead, vocab)) * 3 + offset).astype(dtype)
  targets = jax.random.randint(k[1], lead, 0, vocab)
  weights = jax.random.normal(k[2], lead)
  return logits, targets, weights


@pytest.mark.parametrize("lead,vocab,dtype,offset,tol", [
    ((3, 7), 4352, jnp.bfloat16, 60.0, 2e-2),  # 21 rows (not a multiple of 4), chunks of 256
    ((2, 5), 48, jnp.float32, 0.0, 1e-5),      # chunks of 16
    ((9,), 6144, jnp.float32, -90.0, 1e-5),    # 2048-column chunks; exp(logit) underflows
])
def test_kernel_matches_float64(lead, vocab, dtype, offset, tol):
  logits, targets, weights = inputs(0, lead, vocab, dtype, offset)
  losses, vjp = jax.vjp(lambda x: kernel.cross_entropy(x, targets, interpret=True), logits)
  (grad,) = vjp(weights)
  want_losses, want_grad = float64_losses_and_grad(np.asarray(logits.astype(jnp.float32)),
                                                   targets, weights)
  assert losses.dtype == jnp.float32 and grad.dtype == dtype
  np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=1e-5, atol=1e-4)
  err = np.linalg.norm(np.asarray(grad, np.float64) - want_grad) / np.linalg.norm(want_grad)
  assert err < tol, err


def test_a_confident_targets_gradient_survives_bfloat16():
  # p(target) = 1 - 1e-3: the gradient there is -1e-3 * weight, which bfloat16(p) - 1 would
  # round to 0 (the softmax and the one-hot are rounded once, together).
  vocab = 64
  logits = jnp.zeros((4, vocab)).at[:, 5].set(np.log(999.0 * (vocab - 1))).astype(jnp.bfloat16)
  targets = jnp.full((4,), 5)
  grad = jax.grad(lambda x: jnp.sum(kernel.cross_entropy(x, targets, interpret=True)))(logits)
  _, want = float64_losses_and_grad(np.asarray(logits.astype(jnp.float32)), targets, np.ones(4))
  np.testing.assert_allclose(np.asarray(grad[:, 5], np.float64), want[:, 5], rtol=1e-2)
  assert np.all(np.asarray(grad[:, 5], np.float64) < -5e-4)


def test_bad_shapes_get_one_clear_error():
  with pytest.raises(ValueError, match="multiple of 16"):
    kernel.cross_entropy(jnp.zeros((2, 40)), jnp.zeros((2,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match=r"logits \[..., V\] and targets \[...\]"):
    kernel.cross_entropy(jnp.zeros((2, 48)), jnp.zeros((3,), jnp.int32), interpret=True)


def test_under_a_mesh_each_device_takes_its_rows_and_share_of_the_vocabulary(monkeypatch):
  seen = []
  partials = kernel.partials

  def recording(x, **kw):
    seen.append(x.shape)
    return partials(x, **kw)

  monkeypatch.setattr(kernel, "partials", recording)
  logits, targets, weights = inputs(1, (8, 6), 256, jnp.float32, 0.0)
  mesh = partitioning.make_mesh(4, 2)
  logits = jax.device_put(logits, NamedSharding(mesh, P("data", None, "model")))

  def loss(x):
    return jnp.sum(kernel.cross_entropy(x, targets, interpret=True) * weights)

  with jax.set_mesh(mesh):
    value, grad = jax.jit(jax.value_and_grad(loss))(logits)
  assert seen == [(2 * 6, 128)]  # 2 of 8 rows, 128 of 256 columns a device
  want_losses, want_grad = float64_losses_and_grad(np.asarray(logits), targets, weights)
  np.testing.assert_allclose(float(value), float(np.sum(want_losses * np.asarray(weights))),
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)


def test_a_models_training_loss_with_the_kernel_equals_xlas():
  cfg = dict(family="hawk", vocab_size=256, width=64, lru_width=64, num_layers=1,
             num_heads=2, mlp_expanded_width=128, dtype="bfloat16", logits_soft_cap=0.0)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  micro = {"inputs": tokens, "segment_pos": jnp.broadcast_to(jnp.arange(16), (2, 16)),
           "targets": jnp.roll(tokens, -1, axis=1), "loss_mask": jnp.ones((2, 16))}
  results = {}
  for impl in ("xla", "pallas"):
    model = model_lib.init_model(model_lib.ModelConfig(**cfg, loss_impl=impl), 0)
    assert model.cfg.resolved_loss_impl == impl
    graphdef, params = nnx.split(model)
    results[impl] = jax.jit(jax.value_and_grad(train.make_loss_sum(graphdef), has_aux=True))(
        params, micro)
  (loss_x, count_x), grads_x = results["xla"]
  (loss_p, count_p), grads_p = results["pallas"]
  assert float(count_x) == float(count_p) == 32
  np.testing.assert_allclose(float(loss_p), float(loss_x), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_x), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-4)


def test_which_loss_runs():
  base = model_lib.ModelConfig(family="hawk", vocab_size=32768, logits_soft_cap=0.0)
  assert base.resolved_loss_impl == "xla"  # auto, compiled for the CPU
  capped = model_lib.ModelConfig(family="hawk", vocab_size=32768, loss_impl="pallas")
  assert capped.resolved_loss_impl == "pallas"  # (masked_cross_entropy takes its bound path)
  odd = model_lib.ModelConfig(family="hawk", vocab_size=50257, loss_impl="pallas")
  assert any("model.loss_impl='pallas' needs a model.vocab_size that is a multiple of 16" in e
             for e in odd.errors())
  assert not any("loss_impl" in e for e in base.errors())


def test_a_tpu_target_takes_xlas_loss(monkeypatch):
  # The kernel is Triton: compiled for a TPU, loss_impl=pallas takes XLA's cross-entropy (as the
  # other GPU kernels do there) instead of failing in the Mosaic TPU lowering.
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  logits, targets, _ = inputs(2, (2, 3), 64, jnp.bfloat16, 0.0)
  mask = jnp.ones((2, 3))
  want = train.masked_cross_entropy(logits, targets, mask, 0.0, "xla")
  monkeypatch.setattr(dispatch, "target_platform", lambda: "tpu")
  monkeypatch.setattr(train.loss_kernels, "cross_entropy",
                      lambda *a, **k: pytest.fail("the Triton kernel on a TPU"))
  got = train.masked_cross_entropy(logits, targets, mask, 0.0, "pallas")
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
