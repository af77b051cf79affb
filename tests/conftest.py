"""Tests run on the CPU; several simulated devices for the sharding tests."""

import os
import shutil
import tempfile

from helpers import FAST_COMPILE

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The collectives of the 8 simulated devices meet in a rendezvous that XLA aborts the process
# after 40 s by default; two test workers on two cores can leave a device's thread that long
# without a core, so the limit is raised. FAST_COMPILE as in the scripts the tests start: the
# suite took 1466 and 1342 s with it against 1698 s without (2 cores, 2026-12-02). (It was
# left out here while a sharded evaluation's all-reduces deadlocked with it, before CPU meshes
# evaluated one batch at a time and scripts started without libtpu's variables:
# docs/reliability.md.)
os.environ.setdefault("XLA_FLAGS", " ".join([
    "--xla_force_host_platform_device_count=8", FAST_COMPILE,
    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
    "--xla_cpu_collective_timeout_seconds=300"]))
# libtpu (compile-only TPU devices) takes a lock per process; xdist runs several.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# JAX's persistent compilation cache, new for each test run and shared by its xdist workers
# (which inherit this process' environment) and the scripts the tests start: a program compiled
# again, by another test or after jax.clear_caches(), is loaded instead (test_sampling.py alone
# 11% faster on 2 cores). Programs that compile in under half a second are not written.
# A cache directory set by the caller is theirs: used, and kept.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"recurrentgemma_jax_tests_xla_cache_{os.getpid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_sessionfinish(session):
  del session
  if _OWN_CACHE:  # the run's own process (an xdist worker inherits the variable)
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(items):
  """The `slow` tests first: under pytest-xdist they then start at once instead of being the
  last ones running while the other worker idles."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: keeps order
