"""Tests run on the CPU; several simulated devices for the sharding tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Fewer LLVM passes: the tiny programs compile about a quarter faster (see helpers.FAST_COMPILE).
# The collectives of the 8 simulated devices meet in a rendezvous that XLA aborts the process
# after 40 s by default; two test workers on two cores can leave a device's thread that long
# without a core, so the limit is raised (a real deadlock still ends, after 10 minutes).
os.environ.setdefault("XLA_FLAGS", " ".join([
    "--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=1",
    "--xla_cpu_collective_call_terminate_timeout_seconds=600",
    "--xla_cpu_collective_timeout_seconds=600"]))
# libtpu (compile-only TPU devices) takes a lock per process; xdist runs several.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def pytest_collection_modifyitems(items):
  """The `slow` tests first: under pytest-xdist they then start at once instead of being the
  last ones running while the other worker idles."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: keeps order
