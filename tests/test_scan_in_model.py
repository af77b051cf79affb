"""The Pallas RG-LRU kernels inside the model: training with them matches the XLA scan."""

import numpy as np
import pytest

from test_sharding import losses_on, small_config
import jax


@pytest.mark.parametrize("variant", [{"model.scan_impl": "pallas"},
                                     {"model.fused_rg_lru": "true"}])
def test_griffin_trained_with_the_kernel_matches_the_xla_scan(variant):
  def config(**extra):
    return small_config(**{"model.family": "griffin", "model.width": 32,
                           "model.lru_width": 48, "model.num_heads": 2,
                           "model.num_gate_blocks": 2, "model.mlp_expanded_width": 64,
                           "batch_size": 2, "seq_len": 24, "total_steps": 20, **extra})
  xla, _, _ = losses_on(config(**{"model.scan_impl": "xla_linear"}), jax.devices()[:1], steps=20)
  kernel, _, _ = losses_on(config(**variant), jax.devices()[:1], steps=20)
  np.testing.assert_allclose(kernel, xla, rtol=1e-5)
  assert xla[-1] < xla[0]  # it trained
