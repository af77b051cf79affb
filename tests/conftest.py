"""Tests run on the CPU; several simulated devices for the sharding tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The collectives of the 8 simulated devices meet in a rendezvous that XLA aborts the process
# after 40 s by default; two test workers on two cores can leave a device's thread that long
# without a core, so the limit is raised. (Not helpers.FAST_COMPILE here: with fewer backend
# optimisations a sharded evaluation's all-reduces over the two mesh axes deadlocked, device 4
# never joining either, in 3 of 3 full runs on 2 cores; the scripts the tests start use it.)
os.environ.setdefault("XLA_FLAGS", " ".join([
    "--xla_force_host_platform_device_count=8",
    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
    "--xla_cpu_collective_timeout_seconds=300"]))
# libtpu (compile-only TPU devices) takes a lock per process; xdist runs several.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def pytest_collection_modifyitems(items):
  """The `slow` tests first: under pytest-xdist they then start at once instead of being the
  last ones running while the other worker idles."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: keeps order
