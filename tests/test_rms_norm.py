"""The fused RMSNorm kernel (pallas_kernels.norm) against a float64 reference, forward and
backward, in Pallas' interpreter on the CPU; and its Triton lowering (no GPU needed to lower)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import norm
from recurrentgemma_jax import layers


def f64(a):
  return jnp.asarray(np.asarray(a, np.float64))


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


# bfloat16: y and dx carry their rounding (~1.7e-3 measured).
@pytest.mark.parametrize("shape,dtype,tol", [
    ((3, 37, 96), jnp.float32, 1e-5),      # 111 rows: not a multiple of either row block
    ((2, 5, 1536), jnp.bfloat16, 5e-3),    # chunks of 512 (forward) and 256 (backward)
    ((1, 1, 2560), jnp.float32, 1e-5),     # one row, five or ten chunks
    ((64, 2048), jnp.bfloat16, 5e-3),      # whole row blocks: no padding
])
def test_rms_norm_matches_float64(shape, dtype, tol):
  kx, ks, kd = jax.random.split(jax.random.PRNGKey(sum(shape)), 3)
  x = (3.0 * jax.random.normal(kx, shape) + 0.5).astype(dtype)
  scale = 0.5 * jax.random.normal(ks, shape[-1:], jnp.float32)
  dy = jax.random.normal(kd, shape).astype(dtype)

  y, vjp = jax.vjp(lambda x, s: norm.rms_norm(x, s, interpret=True), x, scale)
  assert y.dtype == dtype and y.shape == shape
  dx, dscale = vjp(dy)
  assert dx.dtype == dtype and dx.shape == shape
  assert dscale.dtype == jnp.float32 and dscale.shape == scale.shape

  with jax.enable_x64(True):
    y_ref, ref_vjp = jax.vjp(lambda x, s: norm.rms_norm_reference(x, s, 1e-6), f64(x), f64(scale))
    dx_ref, dscale_ref = ref_vjp(f64(dy))
  assert rel_err(y, y_ref) < tol
  assert rel_err(dx, dx_ref) < tol
  # dscale is a float32 sum of the (exactly upcast) inputs: float32 accuracy in either dtype.
  assert rel_err(dscale, dscale_ref) < 1e-5


def test_reference_is_the_layer():
  layer = layers.RMSNorm(96)
  layer.scale.value = 0.3 * jax.random.normal(jax.random.PRNGKey(0), (96,))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 96)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(layer(x), norm.rms_norm_reference(x, layer.scale.value, 1e-6))
  assert isinstance(layer, nnx.Module)


def test_supported_widths():
  for d in (16, 96, 1536, 2048, 2560, 4096, 10240):
    assert norm.supported(d), d
  for d in (0, 1, 7, 8, 24, 100, 1000):
    assert not norm.supported(d), d
  with pytest.raises(ValueError, match="power-of-two factor"):
    norm.rms_norm(jnp.zeros((4, 24)), jnp.zeros((24,)), interpret=True)
  with pytest.raises(ValueError, match="scale's shape"):
    norm.rms_norm(jnp.zeros((4, 32)), jnp.zeros((16,)), interpret=True)


def test_lowers_to_triton():
  """Forward and backward lower for a CUDA target (Pallas -> Triton IR; Triton's own compile to
  PTX happens in XLA on a GPU and is not run here): power-of-two tiles out of rows of 1536."""
  def loss(x, s, dy):
    return jnp.sum(norm.rms_norm(x, s).astype(jnp.float32) * dy)
  x = jax.ShapeDtypeStruct((4, 100, 1536), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((1536,), jnp.float32)
  dy = jax.ShapeDtypeStruct((4, 100, 1536), jnp.float32)
  text = jax.jit(jax.grad(loss, (0, 1))).trace(x, s, dy).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 2  # one forward, one backward kernel


def test_griffin_with_the_norm_kernel_equals_the_xla_norms():
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  cfg = model_lib.ModelConfig(family="griffin", vocab_size=41, width=32, num_layers=3,
                              num_heads=2, lru_width=32, mlp_expanded_width=48,
                              attention_window_size=4, dtype="float32", scan_impl="xla_linear")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 41)
  pos = jnp.stack([jnp.arange(11), jnp.concatenate([jnp.arange(4), jnp.arange(7)])])

  def loss_and_grads(norm_impl):
    model = model_lib.Model(model_lib.ModelConfig(**{**cfg.__dict__, "norm_impl": norm_impl}),
                            rngs=nnx.Rngs(0))
    # Scales away from zero, so that a wrong (1 + scale) or its gradient shows.
    for _, v in nnx.iter_graph(model):
      if isinstance(v, layers.RMSNorm):
        v.scale.value = jax.random.normal(jax.random.PRNGKey(3), v.scale.value.shape) * 0.5
    graphdef, params = nnx.split(model)

    def loss(params):
      logits = nnx.merge(graphdef, params)(tokens, pos)[0]
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0] ** 2)
    # 7 norms (2 per block and the final one), each a forward and a backward kernel.
    kernels = str(jax.make_jaxpr(jax.grad(loss))(params)).count("pallas_call")
    assert kernels == (14 if norm_impl == "pallas" else 0), kernels
    return jax.value_and_grad(loss)(params)

  (l_xla, g_xla), (l_kernel, g_kernel) = loss_and_grads("xla"), loss_and_grads("pallas")
  np.testing.assert_allclose(l_kernel, l_xla, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_kernel), jax.tree.leaves(g_xla), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert cfg.resolved_norm_impl == "xla"
  assert model_lib.ModelConfig(norm_impl="cuda").errors() == [
      "model.norm_impl='cuda' is not one of auto|xla|pallas"]
