"""Multi-process start-up: ``jax.distributed.initialize`` when the job has several processes.

Detected: explicit ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``
(what ``scripts/launch_gpus.sh`` sets), SLURM (``SLURM_NTASKS`` > 1), and any Cloud TPU VM (its
chips' device nodes and libtpu), where JAX finds the pod's workers and coordinator itself, from
the VM's metadata (``scripts/launch_tpu_pod.sh``, or train.py started on every worker by hand
with ``gcloud compute tpus tpu-vm ssh --worker=all``). On a TPU VM it is called with one host
too, as JAX recommends for TPUs: without it a pod's preemption notice never reaches the run.
Elsewhere a single process does nothing, also one named by ``JAX_NUM_PROCESSES=1``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Callable, Mapping

import jax

from recurrentgemma_jax.errors import ConfigError, first_line

_initialized = False

# A TPU chip's device nodes: v4 and v5p /dev/accelN, v5e and later /dev/vfio/N.
_TPU_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")


def on_cloud_tpu_vm() -> bool:
  """Whether this machine has TPU chips and libtpu to run them. Read from the file system: the
  JAX backend must not start before ``jax.distributed.initialize``."""
  if not any(glob.glob(node) for node in _TPU_NODES):
    return False
  return importlib.util.find_spec("libtpu") is not None


def arguments(env: Mapping[str, str], tpu_vm: Callable[[], bool]) -> dict | None:
  """``jax.distributed.initialize``'s keyword arguments for this environment (``{}``: JAX
  detects the cluster), or None for a single process without one."""
  if env.get("JAX_COORDINATOR_ADDRESS"):
    values = {}
    for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
      value = env.get(name, "")
      if not value.isdigit():
        given = repr(value) if name in env else "unset"
        raise ConfigError(f"{name} is {given}: with JAX_COORDINATOR_ADDRESS set it must be a "
                          "non-negative integer")
      values[name] = int(value)
    count, index = values["JAX_NUM_PROCESSES"], values["JAX_PROCESS_ID"]
    if not index < count:
      raise ConfigError(f"JAX_PROCESS_ID is {index}: it must be below JAX_NUM_PROCESSES "
                        f"({count})")
    if count == 1 and not tpu_vm():
      # One process has nothing to join (scripts/launch_gpus.sh on one GPU): JAX's service
      # would only log its cancelled task watch at exit (jax 0.11 on a GPU, session 55).
      return None
    return dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=count,
                process_id=index)
  if int(env.get("SLURM_NTASKS", "1")) > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
    return {}  # the cluster environment supplies everything
  # (a run told to keep off the TPUs, JAX_PLATFORMS=cpu, is one process like any other)
  platforms = env.get("JAX_PLATFORMS", "")
  if (not platforms or "tpu" in platforms.split(",")) and tpu_vm():
    return {}
  return None


def initialize() -> None:
  global _initialized
  if _initialized:
    return
  kwargs = arguments(os.environ, on_cloud_tpu_vm)
  if kwargs is not None:
    try:
      jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:
      if arguments(os.environ, lambda: False) is not None:
        raise  # a job that named its processes
      # Only the TPU-VM guess: a machine that looked like one but where JAX finds no cluster.
      # The TPU runtime still joins a pod's hosts; only preemption notices need the service.
      print(f"WARNING: jax.distributed.initialize() failed ({first_line(e, 200)}); running "
            "without JAX's distributed service", file=sys.stderr)
  _initialized = True
