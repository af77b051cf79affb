"""Multi-process start-up: ``jax.distributed.initialize`` when the job has several processes.

Detected: TPU pods (several TPU_WORKER_HOSTNAMES; JAX finds the coordinator itself), SLURM (``SLURM_NTASKS`` > 1) and explicit
``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID`` (what
``scripts/launch_gpus.sh`` sets). A single process does nothing.
"""

from __future__ import annotations

import os

import jax

_initialized = False


def initialize() -> None:
  global _initialized
  if _initialized:
    return
  env = os.environ
  if env.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize(
        coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(env["JAX_NUM_PROCESSES"]),
        process_id=int(env["JAX_PROCESS_ID"]))
  elif int(env.get("SLURM_NTASKS", "1")) > 1 or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
    jax.distributed.initialize()  # the cluster environment supplies everything
  _initialized = True
