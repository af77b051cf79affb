"""Which kernel runs on which platform: the one place that decides.

The platform is the one the program being traced is compiled for, not the host's default
backend: under ``jax.set_mesh(mesh)`` (``partitioning.OnMesh``, ``train.setup``) it is the
platform of the mesh's devices, so a training step traced on a CPU host for compile-only TPU
devices (``jax.experimental.topologies``) holds the Mosaic TPU kernels. Without a mesh it is
``jax.default_backend()``. The Pallas interpreter runs only on a CPU target or when a caller
passes ``interpret=True``.
"""

from __future__ import annotations

import os

import jax


def target_platform() -> str:
  """``"tpu"``, ``"gpu"`` or ``"cpu"``: where the current program will run."""
  platform = None
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  if device is not None:
    platform = device.platform
  platform = platform or jax.default_backend()
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def triton_interpret() -> bool | None:
  """How a Triton kernel (written for GPUs) runs in the current program: compiled on a GPU
  target (False), in Pallas' interpreter on a CPU target (True); None on a TPU target, where
  its caller takes its XLA path instead."""
  platform = target_platform()
  return None if platform == "tpu" else platform != "gpu"


def gpu_capability() -> float | None:
  """The first device's CUDA compute capability (``9.0`` for Hopper), or None where it has none
  (a CPU or TPU, a GPU backend that does not say)."""
  try:
    return float(getattr(jax.devices()[0], "compute_capability", None))
  except (TypeError, ValueError):
    return None


def mosaic_gpu_interpreter(interpret: bool):
  """The ``interpret`` argument of a Mosaic GPU kernel: Pallas' Mosaic GPU interpreter (it
  simulates TMA, barriers and warpgroups on the CPU; ``interpret=True`` would pick the generic
  interpreter, which has no rules for async copies), or None to compile."""
  if not interpret:
    return None
  from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
  return params.InterpretGPUParams()


def interpret_on(platform: str, interpret: bool = False) -> bool:
  """Whether a Pallas kernel runs in its interpreter: asked for, or a CPU target."""
  return interpret or platform == "cpu"


def scan_config(interpret: bool = False):
  """The RG-LRU kernels' ``blocked.ScanConfig`` for the target platform: Mosaic on TPU (its
  interpreter on a CPU or when asked), Triton on GPUs with the linear scan's forward through
  Mosaic GPU on Hopper and newer (measured faster, docs/kernels.md)."""
  from pallas_kernels.rg_lru import blocked, gpu_mosaic  # pylint: disable=g-import-not-at-top
  platform = target_platform()
  if interpret_on(platform, interpret):
    return blocked.ScanConfig(backend="tpu", interpret=True)
  if platform == "gpu":
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return blocked.ScanConfig(
        backend="gpu", gpu_forward="mosaic" if gpu_mosaic.tma_capable(capability) else "triton")
  return blocked.ScanConfig(backend="tpu")


# chunk_gla's GPU path: "fact" (gla.gpu where its shapes are supported, else gla.gpu_xla) or
# "xla" (always gla.gpu_xla); the environment variable is for benchmarks and debugging.
GLA_GPU_IMPL = os.environ.get("GLA_GPU_IMPL", "fact")


def gla_path(kernels: str, key_dim: int, value_dim: int, chunk: int, dtype,
             interpret: bool) -> str:
  """Which chunk_gla implementation runs: ``"tpu"`` (Mosaic, also interpreted on a CPU),
  ``"gpu"`` (Triton, gla.gpu) or ``"gpu_xla"`` (gla.gpu_xla), for ``kernels`` "tpu" or "gpu"."""
  from pallas_kernels.gla import gpu  # pylint: disable=g-import-not-at-top
  if kernels != "gpu":
    return "tpu"
  if GLA_GPU_IMPL == "fact" and gpu.supported(key_dim, value_dim, chunk, dtype, interpret):
    return "gpu"
  return "gpu_xla"


# The GPU decode attention over each row's filled cache slots: "auto" (Mosaic GPU on Hopper
# where its shapes are supported, else Triton), "mosaic" or "triton"; the environment variable
# is for benchmarks and debugging (the tests set this attribute).
DECODE_ATTENTION_IMPL = os.environ.get("DECODE_ATTENTION_IMPL", "auto")


def decode_attention_path(q_shape, cache_shape, dtype) -> str:
  """``"mosaic"`` (pallas_kernels.attention.decode, tensor cores, Hopper only: wgmma) or
  ``"triton"`` (JAX's Pallas GPU decode-attention kernel) for one query token per row against
  a ``[B, S, H]`` cache. On a CPU target both run in their interpreters; "auto" takes Triton's,
  which is faster there."""
  from pallas_kernels.attention import decode  # pylint: disable=g-import-not-at-top
  return _mosaic_on_hopper("DECODE_ATTENTION_IMPL", DECODE_ATTENTION_IMPL,
                           decode.problem(q_shape, cache_shape, dtype))


# The decoding MLP's ``gated_up`` kernel: "auto" (Mosaic GPU on Hopper where it applies, else
# Triton), "mosaic" or "triton"; for benchmarks and debugging, as DECODE_ATTENTION_IMPL.
GATED_UP_IMPL = os.environ.get("GATED_UP_IMPL", "auto")


def gated_up_path(width: int, expanded: int, dtype) -> str:
  """``"mosaic"`` (wgmma, Hopper only) or ``"triton"`` for ``pallas_kernels.mlp.gated_up``. On
  a CPU target both run in their interpreters; "auto" takes Triton's, which is faster there."""
  from pallas_kernels.mlp import gated_up  # pylint: disable=g-import-not-at-top
  return _mosaic_on_hopper("GATED_UP_IMPL", GATED_UP_IMPL,
                           gated_up.mosaic_problem(width, expanded, dtype))


# Greedy decoding's output-layer kernel: "auto" (Mosaic GPU on Hopper where it applies, else
# Triton), "mosaic" or "triton"; for benchmarks and debugging, as DECODE_ATTENTION_IMPL.
GREEDY_IMPL = os.environ.get("GREEDY_IMPL", "auto")


def greedy_path(vocab: int, width: int, dtype) -> str:
  """``"mosaic"`` (wgmma, Hopper only) or ``"triton"`` for ``pallas_kernels.sampling.greedy``.
  On a CPU target both run in their interpreters; "auto" takes Triton's, which is faster
  there."""
  from pallas_kernels.sampling import greedy  # pylint: disable=g-import-not-at-top
  return _mosaic_on_hopper("GREEDY_IMPL", GREEDY_IMPL,
                           greedy.mosaic_problem(vocab, width, dtype))


def _mosaic_on_hopper(name: str, setting: str, problem: str | None) -> str:
  """``"mosaic"`` or ``"triton"`` for a setting ``auto|mosaic|triton`` named ``name``: Triton
  where the Mosaic kernel has a ``problem`` with the shapes, even when asked for; "auto" takes
  Mosaic on Hopper GPUs only."""
  if setting not in ("auto", "mosaic", "triton"):
    raise ValueError(f"{name}={setting!r}: allowed auto, mosaic, triton")
  if setting == "triton" or problem:
    return "triton"
  if setting == "mosaic":
    return "mosaic"
  hopper = target_platform() == "gpu" and int(gpu_capability() or 0) == 9
  return "mosaic" if hopper else "triton"
