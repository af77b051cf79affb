"""The sequence-parallel scan on 4 simulated CPU devices equals the single-device scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_kernels


@pytest.mark.parametrize("reverse", [False, True])
def test_sequence_parallel_scan_matches_single_device(reverse):
  assert len(jax.devices()) >= 4, "tests/conftest.py asks for 8 simulated CPU devices"
  mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
  B, T, D = 2, 48, 24
  kx, ka, kh, ky, kl = jax.random.split(jax.random.PRNGKey(int(reverse)), 5)
  x = jax.random.normal(kx, (B, T, D))
  a = jax.random.uniform(ka, (B, T, D), minval=0.5, maxval=1.0)
  a = a.at[:, 20].set(0.0)  # a zero decay (a document boundary) inside one shard
  h0 = jax.random.normal(kh, (B, D))
  cotangents = (jax.random.normal(ky, (B, T, D)), jax.random.normal(kl, (B, D)))

  def parallel(x, a, h0):
    return pallas_kernels.sequence_parallel_linear_scan(
        x, a, h0, mesh=mesh, axis_name="seq", reverse=reverse)

  def single(x, a, h0):
    return pallas_kernels.linear_scan(x, a, h0, reverse=reverse)

  out, vjp = jax.vjp(parallel, x, a, h0)
  out_ref, vjp_ref = jax.vjp(single, x, a, h0)
  for got, want in zip(out + vjp(cotangents), out_ref + vjp_ref(cotangents)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sequence_parallel_scan_rejects_indivisible_length():
  mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
  x = jnp.zeros((1, 10, 8))
  with pytest.raises(ValueError):
    pallas_kernels.sequence_parallel_linear_scan(x, x, mesh=mesh, axis_name="seq")
