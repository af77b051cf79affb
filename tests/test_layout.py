"""The kernel packages' public calls: every documented entry point imports, and each package's
``__init__`` lists what it exports."""

import importlib

import pytest

PACKAGES = {
    "pallas_kernels": ["chunk_gla", "gla_recurrent_step", "gla_reference", "linear_scan",
                       "linear_scan_reference", "rg_lru", "rg_lru_reference",
                       "sequence_parallel_linear_scan"],
    "pallas_kernels.rg_lru": ["linear_scan", "linear_scan_reference", "rg_lru",
                              "rg_lru_reference", "sequence_parallel_linear_scan"],
    "pallas_kernels.gla": ["chunk_gla", "gla_recurrent_step", "gla_reference"],
    "pallas_kernels.gates": ["block_diagonal_matmul", "block_diagonal_with_skip", "supported"],
    "pallas_kernels.mlp": ["gated_gelu", "supported"],
    "pallas_kernels.conv1d": ["causal_conv1d", "forward", "supported"],
}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_package_exports_its_documented_calls(package):
  module = importlib.import_module(package)
  assert sorted(module.__all__) == sorted(PACKAGES[package])
  for name in module.__all__:
    assert callable(getattr(module, name)), name


def test_dispatch_decides_for_the_platform_compiled_for():
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  assert dispatch.target_platform() == "cpu"
  assert dispatch.gla_path("tpu", 128, 256, 64, "bfloat16", False) == "tpu"
  assert dispatch.gla_path("gpu", 128, 256, 64, "bfloat16", False) == "gpu"
  assert dispatch.gla_path("gpu", 24, 32, 64, "bfloat16", False) == "gpu_xla"
