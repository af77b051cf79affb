"""The block-diagonal gate kernel (pallas_kernels.gates) against a float64 reference,
forward and backward, in Pallas' interpreter on the CPU; and a model using it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from pallas_kernels.gates import block_diagonal
from recurrentgemma_jax import model as model_lib


def reference(x, w):  # float64 NumPy
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  h, i, j = w.shape
  xb = x.reshape(*x.shape[:-1], h, i)
  return np.einsum("...hi,hij->...hj", xb, w).reshape(*x.shape[:-1], h * j)


@pytest.mark.parametrize("shape,blocks,dtype,tol,bias", [
    ((300, 3 * 16), (3, 16, 32), jnp.float32, 1e-5, True),   # N not a multiple of any tile
    ((1, 2 * 32), (2, 32, 16), jnp.float32, 1e-5, False),    # one row
    ((2, 37, 4 * 16), (4, 16, 16), jnp.bfloat16, 2e-2, True),
    ((2, 37, 4 * 16), (4, 16, 16), jnp.bfloat16, 2e-2, False),
    # blocks that are not powers of two, cut into pieces (48 = 32 + 16, 80 = 64 + 16)
    ((300, 3 * 48), (3, 48, 80), jnp.float32, 1e-5, True),
    ((2, 37, 2 * 96), (2, 96, 96), jnp.bfloat16, 2e-2, True),
])
def test_block_diagonal_matmul_matches_float64(shape, blocks, dtype, tol, bias):
  kx, kw, kd, kb = jax.random.split(jax.random.PRNGKey(sum(shape)), 4)
  x = jax.random.normal(kx, shape).astype(dtype)
  w = jax.random.normal(kw, blocks, jnp.float32)
  h, i, j = blocks
  b = 3.0 * jax.random.normal(kb, (h, j), jnp.float32) if bias else None
  y = block_diagonal.block_diagonal_matmul(x, w, b, interpret=True)
  assert y.dtype == dtype and y.shape == (*shape[:-1], blocks[0] * blocks[2])
  want = reference(x, np.asarray(w.astype(dtype))) + (np.asarray(b).reshape(-1) if bias else 0)
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())

  dy = jax.random.normal(kd, y.shape).astype(dtype)
  grads = jax.grad(lambda x, w, b: jnp.sum(
      block_diagonal.block_diagonal_matmul(x, w, b, interpret=True).astype(jnp.float32)
      * dy.astype(jnp.float32)), (0, 1, 2) if bias else (0, 1))(x, w, b)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  w64 = np.asarray(w.astype(dtype), np.float64)
  want_dx = np.einsum("...hj,hij->...hi", dy64.reshape(*shape[:-1], h, j), w64).reshape(shape)
  want_dw = np.einsum("nhi,nhj->hij", x64.reshape(-1, h, i), dy64.reshape(-1, h, j))
  wants = [want_dx, want_dw] + ([dy64.reshape(-1, h, j).sum(0)] if bias else [])
  assert len(grads) == len(wants)
  for got, want in zip(grads, wants):
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < tol, err


@pytest.mark.parametrize("shape,blocks,dtype,tol", [
    ((300, 3 * 16), (3, 16, 32), jnp.float32, 1e-5),   # N not a multiple of any tile, I != J
    ((2, 37, 4 * 16), (4, 16, 16), jnp.bfloat16, 2e-2),
    ((1100, 2 * 80), (2, 80, 48), jnp.float32, 1e-5),   # pieces; two dw row spans
    ((3, 50, 2 * 160), (2, 160, 160), jnp.bfloat16, 2e-2),  # Griffin 1.3B's blocks (128 + 32)
])
def test_both_gates_with_the_skip_match_float64(shape, blocks, dtype, tol):
  """The model's form: two weights on one read of x, x passed through, and the backward's dx
  summing the skip's gradient with both products."""
  keys = jax.random.split(jax.random.PRNGKey(len(shape)), 8)
  h, i, j = blocks
  x = jax.random.normal(keys[0], shape).astype(dtype)
  ws = [jax.random.normal(k, blocks, jnp.float32) for k in keys[1:3]]
  bs = [3.0 * jax.random.normal(k, (h, j), jnp.float32) for k in keys[3:5]]
  skip, ys = block_diagonal.block_diagonal_with_skip(x, ws, bs, interpret=True)
  assert skip is x or np.array_equal(np.asarray(skip), np.asarray(x))
  assert len(ys) == 2 and all(y.dtype == dtype for y in ys)
  for y, w, b in zip(ys, ws, bs):
    want = reference(x, np.asarray(w.astype(dtype))) + np.asarray(b).reshape(-1)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol,
                               atol=tol * np.abs(want).max())

  ds = jax.random.normal(keys[5], shape).astype(dtype)
  dys = [jax.random.normal(k, (*shape[:-1], h * j)).astype(dtype) for k in keys[6:8]]

  def loss(x, ws, bs):
    skip, ys = block_diagonal.block_diagonal_with_skip(x, ws, bs, interpret=True)
    outs = [skip, *ys]
    return sum(jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))
               for o, c in zip(outs, [ds, *dys]))

  dx, dws, dbs = jax.grad(loss, (0, 1, 2))(x, ws, bs)
  x64 = np.asarray(x, np.float64).reshape(-1, h, i)
  dy64 = [np.asarray(dy, np.float64).reshape(-1, h, j) for dy in dys]
  w64 = [np.asarray(w.astype(dtype), np.float64) for w in ws]
  want_dx = np.asarray(ds, np.float64) + sum(
      np.einsum("nhj,hij->nhi", dy, w).reshape(shape) for dy, w in zip(dy64, w64))
  wants = [want_dx] + [np.einsum("nhi,nhj->hij", x64, dy) for dy in dy64] + [
      dy.sum(0) for dy in dy64]
  for got, want in zip([dx, *dws, *dbs], wants):
    assert got.dtype == (dtype if got is dx else jnp.float32)
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < tol, err


def test_block_diagonal_rejects_blocks_the_kernel_cannot_take():
  assert block_diagonal.supported(160, 160) and block_diagonal.supported(128, 128)
  assert not block_diagonal.supported(24, 24) and not block_diagonal.supported(8, 16)
  assert [block_diagonal.pieces(n) for n in (16, 256, 160, 48)] == [
      [(0, 16)], [(0, 256)], [(0, 128), (128, 32)], [(0, 32), (32, 16)]]
  assert block_diagonal.pieces(352) == [(0, 128), (128, 128), (256, 64), (320, 32)]
  with pytest.raises(ValueError, match="multiples of 16"):
    block_diagonal.block_diagonal_matmul(jnp.zeros((4, 2 * 24)), jnp.zeros((2, 24, 24)))
  with pytest.raises(ValueError, match=r"the bias is \(32,\), not \[H, J\]"):
    block_diagonal.block_diagonal_matmul(jnp.zeros((4, 32)), jnp.zeros((2, 16, 16)),
                                         jnp.zeros((32,)))
  with pytest.raises(ValueError, match="as many biases as weights"):
    block_diagonal.block_diagonal_with_skip(jnp.zeros((4, 32)), [jnp.zeros((2, 16, 16))] * 2,
                                            [jnp.zeros((2, 16))])


@pytest.mark.parametrize("lru_width", [32, 96])  # blocks of 16; of 48 (pieces 32 + 16)
def test_griffin_with_the_gate_kernel_equals_the_xla_gates(lru_width):
  cfg = model_lib.ModelConfig(family="griffin", vocab_size=41, width=32, num_layers=3,
                              num_heads=2, lru_width=lru_width, mlp_expanded_width=48,
                              attention_window_size=4, dtype="float32", scan_impl="xla_linear")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 11), 0, 41)
  pos = jnp.stack([jnp.arange(11), jnp.concatenate([jnp.arange(4), jnp.arange(7)])])

  (l_xla, g_xla, k_xla), (l_kernel, g_kernel, k_kernel) = helpers.xla_and_kernel_runs(
      cfg, "gate_impl", tokens, pos)
  # The kernel runs (2 gates x 2 recurrent blocks) only where asked for.
  assert k_xla == 0 and k_kernel > 0, (k_xla, k_kernel)
  np.testing.assert_allclose(l_kernel, l_xla, rtol=1e-5)
  helpers.assert_grads_close(g_kernel, g_xla)
  assert cfg.resolved_gate_impl == "xla"  # auto: the kernels only on GPUs
  assert not cfg.resolved_fused_rg_lru and dataclasses.replace(
      cfg, fused_rg_lru="true").resolved_fused_rg_lru
  assert dataclasses.replace(cfg, fused_rg_lru=True).resolved_fused_rg_lru  # older checkpoints
  assert dataclasses.replace(cfg, fused_rg_lru="yes").errors() == [
      "model.fused_rg_lru='yes' is not one of auto|true|false"]
  assert dataclasses.replace(cfg, gate_impl="cuda").errors() == [
      "model.gate_impl='cuda' is not one of auto|xla|pallas"]


def test_gpu_kernel_check_script_passes_every_kernel_and_flags_a_wrong_one(monkeypatch, capsys):
  """scripts/bench/check_gpu_kernels.py on its tiny shapes (interpreted on the CPU), float32
  (each kernel's own tests cover bfloat16): every kernel row passes against float64; a kernel
  made wrong is reported FAILED, exit status 1."""
  from test_errors import load_script
  check = load_script("bench/check_gpu_kernels")
  monkeypatch.setattr("sys.argv", ["check_gpu_kernels.py", "--tiny", "--dtypes=float32"])
  with pytest.raises(SystemExit) as exit_:
    check.main()
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
  assert exit_.value.code == 0 and len(rows) == 16, rows
  assert all("| float32 |" in row for row in rows), rows
  assert all("| ok |" in row for row in rows), rows

  wrong = lambda x, w, b: block_diagonal.block_diagonal_matmul(x, w, b, interpret=True) * 1.01
  ok, detail = check.check("block_diagonal", wrong, check._block_diagonal_reference,
                           [("x", (64, 4 * 16)), ("param", (4, 16, 16)), ("param", (4, 16))],
                           "float32",
                           jax.random.PRNGKey(0))
  assert not ok and float(detail.split()[0]) > 5e-3, detail
