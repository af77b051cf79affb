"""The recurrent block's Conv1D with the Triton backward (pallas_kernels.conv1d) against float64,
forward and backward, in Pallas' interpreter on the CPU; and a Griffin model using it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from pallas_kernels.conv1d import causal as kernel
from recurrentgemma_jax import layers
from recurrentgemma_jax import model as model_lib


def reference(x, w, b, doc, dy):
  """float64 NumPy, tap by tap: y and the gradients of sum(y * dy)."""
  x, w, b, dy = (np.asarray(a, np.float64) for a in (x, w, b, dy))
  doc = np.asarray(doc)
  batch, length, _ = x.shape
  width = w.shape[0]
  y = np.broadcast_to(b, x.shape).copy()
  dx, dw = np.zeros_like(x), np.zeros_like(w)
  for r in range(batch):
    for t in range(length):
      for s in range(min(width, t + 1)):
        if doc[r, t - s] == doc[r, t]:
          y[r, t] += w[width - 1 - s] * x[r, t - s]
          dx[r, t - s] += w[width - 1 - s] * dy[r, t]
          dw[width - 1 - s] += x[r, t - s] * dy[r, t]
  return y, dx, dw, dy.sum((0, 1))


def documents(key, batch, length):
  """Document numbers of packed rows: several documents a row, the first often begun in an
  earlier row (its positions do not start at 0)."""
  pos = []
  for r in range(batch):
    cuts = np.sort(jax.random.choice(jax.random.fold_in(key, r), length, (3,), replace=False))
    p = np.arange(length) + 5 * r
    for c in cuts:
      p[c:] = np.arange(length - c)
    pos.append(p)
  return layers.document_ids(jnp.asarray(np.stack(pos)))


@pytest.mark.parametrize("shape,width,dtype,tol", [
    ((2, 64, 32), 4, jnp.float32, 1e-5),     # whole 16-row tiles, 32-channel programs
    ((3, 37, 48), 4, jnp.float32, 1e-5),     # rows past T masked, 16-channel programs
    ((1, 300, 64), 4, jnp.float32, 1e-5),    # two programs of 16 tiles along time, the second
                                             # ending past T with tiles wholly outside it
    ((1, 3, 16), 4, jnp.float32, 1e-5),      # fewer tokens than taps
    ((2, 45, 64), 2, jnp.float32, 1e-5),     # two taps
    ((2, 50, 128), 4, jnp.bfloat16, 1e-2),
    ((2, 23, 20), 4, jnp.float32, 1e-5),     # D not a multiple of 16: the jnp backward
])
def test_causal_conv1d_matches_float64(shape, width, dtype, tol):
  kx, kw, kb, kd, kdoc = jax.random.split(jax.random.PRNGKey(sum(shape) + width), 5)
  x = jax.random.normal(kx, shape).astype(dtype)
  w = jax.random.normal(kw, (width, shape[2]))   # float32 parameters, as in the model
  b = jax.random.normal(kb, (shape[2],))
  dy = jax.random.normal(kd, shape).astype(dtype)
  doc = documents(kdoc, *shape[:2]) if shape[1] > 3 else jnp.zeros(shape[:2], jnp.int32)
  assert kernel.supported(shape[2]) == (shape[2] % 16 == 0)
  want = reference(x, w.astype(dtype), b.astype(dtype), doc, dy)

  y = kernel.causal_conv1d(x, w, b, doc, interpret=True)
  assert y.dtype == dtype and y.shape == shape
  grads = jax.grad(lambda x, w, b: jnp.sum(
      kernel.causal_conv1d(x, w, b, doc, interpret=True).astype(jnp.float32)
      * dy.astype(jnp.float32)), (0, 1, 2))(x, w, b)
  assert [g.dtype for g in grads] == [dtype, jnp.float32, jnp.float32]
  for got, expected in zip((y, *grads), want):
    err = np.linalg.norm(np.asarray(got, np.float64) - expected) / np.linalg.norm(expected)
    assert err < tol, err


def test_causal_conv1d_rejects_wrong_shapes():
  with pytest.raises(ValueError, match=r"x \[B, T, D\], w \[W, D\], b \[D\], doc \[B, T\]"):
    kernel.causal_conv1d(jnp.zeros((2, 8, 16)), jnp.zeros((4, 8)), jnp.zeros((16,)),
                         jnp.zeros((2, 8), jnp.int32))


def test_griffin_with_the_conv1d_kernel_equals_xla_autodiff():
  cfg = model_lib.ModelConfig(family="griffin", vocab_size=41, width=32, num_layers=3,
                              num_heads=2, lru_width=48, attention_window_size=4,
                              dtype="float32")
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 13), 0, 41)
  pos = jnp.stack([jnp.arange(13) + 7, jnp.concatenate([jnp.arange(5), jnp.arange(8)])])

  (l_xla, g_xla, k_xla), (l_kernel, g_kernel, k_kernel) = helpers.xla_and_kernel_runs(
      dataclasses.replace(cfg, fused_rg_lru="false", gate_impl="xla", mlp_impl="xla",
                          scan_impl="xla_linear"), "conv1d_impl", tokens, pos)
  # One kernel per recurrent layer (2 of 3), in the backward, only where asked for.
  assert (k_xla, k_kernel) == (0, 2)
  assert l_kernel == l_xla  # the same jnp forward
  helpers.assert_grads_close(g_kernel, g_xla)
  assert cfg.resolved_conv1d_impl == "xla"  # auto: the kernel only on GPUs
  assert dataclasses.replace(cfg, conv1d_impl="triton").errors() == [
      "model.conv1d_impl='triton' is not one of auto|xla|pallas"]


def test_conv1d_backward_lowers_for_a_gpu():
  # The Triton kernel lowers for CUDA on this CPU machine (no GPU needed): Griffin 400M's
  # layer shape, and an odd length whose last tile is masked.
  for t in (2048, 37):
    x = jax.ShapeDtypeStruct((2, t, 2048), jnp.bfloat16)
    w, b = jax.ShapeDtypeStruct((4, 2048), jnp.float32), jax.ShapeDtypeStruct((2048,), jnp.float32)
    doc = jax.ShapeDtypeStruct((2, t), jnp.int32)

    def fwd_bwd(x, w, b, doc, dy):
      y, vjp = jax.vjp(lambda x, w, b: kernel.causal_conv1d(x, w, b, doc), x, w, b)
      return y, vjp(dy)
    text = helpers.lower_for_cuda(fwd_bwd, x, w, b, doc, x)
    assert text.count("@__gpu$xla.gpu.triton") == 1, t
