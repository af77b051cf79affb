"""Tests run on the CPU; several simulated devices for the sharding tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# libtpu (compile-only TPU devices) takes a lock per process; xdist runs several.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
