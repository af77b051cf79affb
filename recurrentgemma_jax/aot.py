"""The training step compiled ahead of time for devices that need not be attached: how much HBM
it takes per chip, what it computes, and whether it fits.

``scripts/compile_tpu.py`` compiles for a Cloud TPU slice named as Cloud TPU names them
(``v5p-128``) on a machine without a TPU: :func:`parse_slice` turns the name into a
:class:`TpuSlice`, whose ``devices()`` are libtpu's compile-only devices of that topology
(``jax.experimental.topologies``). :func:`compile_step` takes a run config and any list of
devices (those, or the real ones of a run) and compiles exactly what ``train.run`` would run on
them: ``train.setup`` (mesh, shardings, ZeRO stage), ``Setup.jit_train_step`` (remat, gradient
accumulation, kernels chosen for the devices' platform) and ``Setup.jit_eval_step``. Its
:class:`StepReport` holds XLA's per-device memory analysis, the step's FLOPs and bytes (loops
counted every iteration, ``hlo_cost``), the number of Mosaic kernels, and a roofline bound.

Nothing is allocated and no data is read: the batch is abstract, shaped like
``data.pipeline``'s.

The same compiled memory is the fit check of every entry point, before it allocates anything:
:func:`fit_check` for ``train.run``; :func:`check_program` for the programs of
``scripts/sample.py`` and ``scripts/evaluate.py``, compiled for the abstract model of a
checkpoint (:func:`checkpoint_model`) before its parameters are read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from recurrentgemma_jax import configlib, flops, hlo_cost
from recurrentgemma_jax.errors import ConfigError, first_line

GIB = 2**30


class CompileError(RuntimeError):
  """The step could not be compiled for a reason other than its size."""


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation, per chip (Cloud TPU system-architecture pages; peaks: ``flops.py``)."""

  generation: str             # "v5p"
  device_kind: str            # jax's ``Device.device_kind``
  hbm_bytes: int
  hbm_bandwidth: float        # bytes/s
  ici_bandwidth: float | None  # bytes/s, bidirectional, per chip (None: not published)
  cores_in_name: int          # TensorCores per chip that the slice name counts (v4, v5p: 2)
  accelerator_prefix: str     # Cloud's accelerator-type prefix ("v5litepod" for v5e)
  chip_config: str            # libtpu's chip configuration (one device per chip)
  host_bounds: tuple[int, int, int]  # chips per host in a multi-host slice
  topologies: tuple[tuple[int, str], ...]  # (chips, topology) of Cloud's slice shapes

  @property
  def peak_flops(self) -> float:
    return flops.PEAK_FLOPS[self.device_kind]


_3D = ((4, "2x2x1"), (8, "2x2x2"), (16, "2x2x4"), (32, "2x4x4"), (64, "4x4x4"),
       (128, "4x4x8"), (256, "4x8x8"), (512, "8x8x8"), (1024, "8x8x16"), (2048, "8x16x16"))
_2D = ((1, "1x1"), (4, "2x2"), (8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8"),
       (128, "8x16"), (256, "16x16"))

# Sources: cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e (system architecture and slice shapes).
CHIPS = {
    "v4": Chip("v4", "TPU v4", 32 * GIB, 1200e9, None, 2, "v4", "megacore", (2, 2, 1),
               _3D[:-2] + ((768, "8x8x12"),) + _3D[-2:]),
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 400e9, 1, "v5litepod", "default",
                (2, 4, 1), _2D),
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 2765e9, 1200e9, 2, "v5p", "default", (2, 2, 1),
                _3D + ((4096, "16x16x16"), (6144, "16x16x24"))),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 1640e9, 800e9, 1, "v6e", "default",
                (2, 4, 1), _2D),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """A Cloud TPU slice (times ``num_slices`` joined over the data-centre network)."""

  chip: Chip
  chips: int          # per slice
  topology: str       # "4x4x4"
  num_slices: int = 1

  @property
  def name(self) -> str:
    return f"{self.chip.generation}-{self.chips * self.chip.cores_in_name}"

  @property
  def accelerator_type(self) -> str:
    """What ``gcloud compute tpus tpu-vm describe`` calls it (``v5litepod-16`` for v5e)."""
    return f"{self.chip.accelerator_prefix}-{self.chips * self.chip.cores_in_name}"

  @property
  def total_chips(self) -> int:
    return self.chips * self.num_slices

  def devices(self) -> list:
    """libtpu's compile-only devices of this slice (nothing needs a TPU)."""
    _quiet_libtpu(self.accelerator_type)
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    host = self.chip.host_bounds
    if self.chips < math.prod(host):  # a slice smaller than one host: the slice is the host
      dims = [int(n) for n in self.topology.split("x")]
      host = tuple(dims + [1] * (3 - len(dims)))
    try:
      topology = topologies.get_topology_desc(
          platform="tpu", topology_name=f"{self.chip.generation}:{self.topology}",
          chip_config_name=self.chip.chip_config, chips_per_host_bounds=host,
          num_slices=self.num_slices)
    except Exception as e:  # pylint: disable=broad-except  (no libtpu, or one that is too old)
      raise CompileError(f"libtpu cannot describe {self.name} ({first_line(e, 200)}); "
                         "compiling for TPUs needs it: pip install -e '.[tpu]'") from None
    return list(topology.devices)


def _quiet_libtpu(accelerator_type: str) -> None:
  """Environment defaults that let libtpu start on a host without a TPU without printing
  warnings about its missing metadata, and beside other processes (compiling touches no TPU).
  Read when libtpu loads, i.e. on the first call; never overrides a value already set."""
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def slice_names() -> str:
  return ", ".join(f"{c.generation}-{c.topologies[0][0] * c.cores_in_name}..."
                   f"{c.topologies[-1][0] * c.cores_in_name}" for c in CHIPS.values())


def parse_slice(name: str, num_slices: int = 1) -> TpuSlice:
  """``v4-8``, ``v5e-256`` (or ``v5litepod-256``), ``v5p-128``, ``v6e-64`` -> the slice; v4 and
  v5p names count TensorCores (two per chip), v5e and v6e names count chips."""
  m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name.strip().lower())
  generation = _ALIASES.get(m.group(1), m.group(1)) if m else None
  if generation not in CHIPS:
    raise ConfigError(f"--topology {name!r} is not a Cloud TPU slice name ({slice_names()})")
  chip = CHIPS[generation]
  count = int(m.group(2))
  shapes = dict(chip.topologies)
  if count % chip.cores_in_name or count // chip.cores_in_name not in shapes:
    sizes = "|".join(str(n * chip.cores_in_name) for n, _ in chip.topologies)
    raise ConfigError(f"--topology {name!r}: {generation} slices are {generation}-{{{sizes}}}")
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ConfigError(f"--num_slices={num_slices!r} must be a positive integer")
  chips = count // chip.cores_in_name
  return TpuSlice(chip, chips, shapes[chips], num_slices)


def chip_of(device) -> Chip | None:
  """The table entry of a device's TPU generation, or None (CPUs, GPUs, unknown TPUs)."""
  kind = getattr(device, "device_kind", "")
  return next((c for c in CHIPS.values() if c.device_kind == kind), None)


def device_memory(device) -> int | None:
  """Bytes one device can hold: the runtime's limit on GPUs and TPUs (the table's for
  compile-only TPUs); on a CPU the machine's available memory shared by its local devices."""
  if device.platform == "cpu":
    try:
      with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
      available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
      return None
    return available // max(1, len(device.client.local_devices()))
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # pylint: disable=broad-except  (compile-only devices have no runtime)
    limit = None
  if limit:
    return int(limit)
  chip = chip_of(device)
  return chip.hbm_bytes if chip else None


def offline_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of ``config`` that compiles the same step without the run's data or checkpoint,
  which may live on the pod or in a bucket: the documents come from the built-in corpus (shapes
  do not depend on them) and ``init_from`` is dropped (shapes come from the config). A
  SentencePiece tokenizer that is not a local file needs ``model.vocab_size``."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.init_from = ""
  if c.data.source != "synthetic":
    c.data.source, c.data.paths, c.data.eval_paths = "builtin", "", ""
    tokenizer = c.data.tokenizer
    if tokenizer != "byte" and not os.path.isfile(os.path.expanduser(tokenizer)):
      if not c.model.vocab_size:
        raise ConfigError(f"data.tokenizer={tokenizer!r} is not a local file; give its "
                          "vocabulary size as --config.model.vocab_size to compile without it")
      c.data.tokenizer = "byte"
  return c


def validate(config: ml_collections.ConfigDict, devices) -> None:
  """``configlib.validate`` for a run on ``devices`` (one process per host)."""
  processes = len({d.process_index for d in devices})
  configlib.validate(config, process_count=processes, device_count=len(devices))
  check_devices(config, devices)


def check_devices(config: ml_collections.ConfigDict, devices) -> None:
  """What the config asks of kernels that ``devices`` cannot compile: a ConfigError."""
  blocks = config.model.block_types or config.model.family
  if "gla" in blocks and any(d.device_kind == "TPU v4" for d in devices):
    raise ConfigError("GLA blocks do not compile for TPU v4 (chunk_gla's gather is not in v4's "
                      "Mosaic: tpu.dynamic_gather); v5e, v5p and v6e compile them")


def human_bytes(n: float | None) -> str:
  if n is None:
    return "?"
  if abs(n) >= GIB:
    return f"{n / GIB:.2f} GiB"
  return f"{n / 2**20:.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KiB"


# -- compiling ---------------------------------------------------------------------------------


def _platform(compiled) -> str | None:
  """The platform of a compiled program's devices ("tpu", "gpu", "cpu"), None if it has no
  inputs to tell."""
  for sharding in jax.tree.leaves(compiled.input_shardings):
    for device in getattr(sharding, "device_set", ()):
      return device.platform
  return None


@dataclasses.dataclass
class Memory:
  """Bytes per device of one compiled program (``compiled.memory_analysis()``)."""

  arguments: int = 0
  outputs: int = 0
  aliased: int = 0      # outputs written over donated arguments (counted once)
  temporaries: int = 0
  code: int = 0         # the program itself
  needed: int | None = None     # a program that did not compile: what the compiler asked for
  available: int | None = None  # ... and what it had

  @classmethod
  def of(cls, compiled) -> "Memory":
    """The memory of a compiled program (``jax.jit(f).lower(...).compile()``).

    On TPUs the temporaries are the buffer assignment's peak (``peak_memory_in_bytes``, the
    arguments and outputs included) less the arguments and outputs: libtpu's
    ``temp_size_in_bytes`` counts more than is ever live at once (MQA 1.3B sampling 256 rows
    on a v5e: 23.99 GiB of temporaries, while the peak, 15.38 GiB, compiles within the chip's
    15.75 GiB and 512 rows are refused at 27.55 GiB, the compiler's own figure)."""
    stats = compiled.memory_analysis()
    arguments, outputs = stats.argument_size_in_bytes, stats.output_size_in_bytes
    aliased, temporaries = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
    if peak and _platform(compiled) == "tpu":
      temporaries = max(0, peak - (arguments + outputs - aliased))
    return cls(arguments, outputs, aliased, temporaries, stats.generated_code_size_in_bytes)

  @property
  def total(self) -> int:
    if self.needed is not None:
      return self.needed
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

  def as_dict(self) -> dict[str, int]:
    return {"arguments": self.arguments, "outputs": self.outputs, "aliased": self.aliased,
            "temporaries": self.temporaries, "code": self.code, "total": self.total}


@dataclasses.dataclass
class Program:
  """One compiled (or refused) program."""

  compiled: Any | None
  memory: Memory
  compile_s: float
  error: str | None = None       # why it did not compile
  out_of_memory: bool = False    # the compiler ran out of HBM

  def fits(self, limit: int | None) -> bool:
    """Compiled, and within ``limit`` bytes per device (None: unknown, taken to fit)."""
    return self.compiled is not None and (limit is None or self.memory.total <= limit)


_OOM_PATTERNS = (  # the TPU compiler's words for "does not fit", sizes in G/M/K bytes
    r"required for [^(]*\(([\d.]+)([KMGT])\) exceeds available [^(]*\(([\d.]+)([KMGT])\)",
    r"[Uu]sed ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm",
)


def _size(value: str, unit: str) -> int:
  return int(float(value) * 1024 ** " KMGT".index(unit))


def _compile(lowered) -> Program:
  """Compiles a lowered program (``jax.jit(f).lower(...)``), keeping a refusal for its size
  (out of memory while compiling) as a Program without ``compiled``."""
  started = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  (XLA raises JaxRuntimeError)
    text = str(e)
    elapsed = time.perf_counter() - started
    if "shared memory size limit" in text.lower():  # a kernel's tiles, not the device's memory
      return Program(None, Memory(), elapsed,
                     f"a kernel's tiles need more shared memory than the device has "
                     f"({first_line(e, 400)}); the XLA paths avoid the Pallas kernels: "
                     f"--config.model.fused_rg_lru=false --config.model.gate_impl=xla "
                     f"--config.model.mlp_impl=xla --config.model.conv1d_impl=xla "
                     f"--config.model.scan_impl=xla_linear (please report the config)")
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
      memory = Memory()
      for pattern in _OOM_PATTERNS:
        m = re.search(pattern, text)
        if m:
          memory.needed, memory.available = _size(*m.group(1, 2)), _size(*m.group(3, 4))
          break
      return Program(None, memory, elapsed, first_line(e, 400), out_of_memory=True)
    return Program(None, Memory(), elapsed, first_line(e, 400))
  return Program(compiled, Memory.of(compiled), time.perf_counter() - started)


def abstract_batch(config: ml_collections.ConfigDict, sharding, *, seq_len: int | None = None):
  """The global batch ``train.run`` feeds, as ShapeDtypeStructs: the fields and dtypes of
  ``data.pipeline`` (read off its own row-to-batch function)."""
  from recurrentgemma_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  t = seq_len or config.seq_len
  zeros = np.zeros((1, t + 1), np.int32)
  layout = pipeline._to_batch(  # pylint: disable=protected-access
      {"tokens": zeros, "tokens_segment_ids": zeros, "tokens_positions": zeros})
  return {k: jax.ShapeDtypeStruct((config.batch_size, t), v.dtype, sharding=sharding)
          for k, v in layout.items()}


@dataclasses.dataclass
class StepReport:
  """What the compiled training step of one config takes and does on one set of devices."""

  devices: int
  device_kind: str
  mesh: dict[str, int]
  zero: int
  remat: str
  accum_steps: int
  micro_batch_rows: int      # rows per data shard in one micro-batch
  seq_len: int
  tokens_per_step: int       # global
  parameters: int
  model_flops_per_token: float  # flops.py: training FLOPs per token (MFU's numerator)
  hbm_per_chip_bytes: int | None
  train: Program
  eval: Program | None = None
  flops_per_step: float | None = None   # per device, compiled, every loop iteration counted
  bytes_per_step: float | None = None   # per device, HBM bytes accessed, likewise
  xla_flops: float | None = None        # XLA's own figures (loop bodies counted once)
  xla_bytes: float | None = None
  unknown_loops: int = 0
  mosaic_kernels: int | None = None
  peak_flops: float | None = None
  hbm_bandwidth: float | None = None
  compile_s: float = 0.0   # wall time of the compiles (side by side)
  unsplit_note: str | None = None  # train.Setup's: what tensor parallelism leaves whole

  @property
  def programs(self) -> list[Program]:
    return [p for p in (self.train, self.eval) if p is not None]

  @property
  def compiled_ok(self) -> bool:
    return all(p.compiled is not None for p in self.programs)

  @property
  def fits(self) -> bool:
    if not self.compiled_ok:
      return False
    limit = self.hbm_per_chip_bytes
    return limit is None or all(p.memory.total <= limit for p in self.programs)

  @property
  def worst(self) -> Program:
    """The program furthest over (or closest to) the HBM limit."""
    failed = [p for p in self.programs if p.compiled is None]
    return failed[0] if failed else max(self.programs, key=lambda p: p.memory.total)

  def roofline(self) -> dict[str, Any] | None:
    """A lower bound on the step time per chip: the larger of compute at peak FLOP/s (the
    compiled FLOPs, or the model's where more) and HBM traffic at full bandwidth; tokens/s per
    chip and MFU at that time."""
    if not (self.flops_per_step and self.bytes_per_step and self.peak_flops
            and self.hbm_bandwidth):
      return None
    # Mosaic kernels declare no FLOPs to XLA: the model's own count bounds the compute below.
    work = max(self.flops_per_step, self.model_flops_per_token * self.tokens_per_step
               / self.devices)
    compute = work / self.peak_flops
    memory = self.bytes_per_step / self.hbm_bandwidth
    step = max(compute, memory)
    per_chip = self.tokens_per_step / self.devices / step
    return {"step_time_s": step, "compute_s": compute, "memory_s": memory, "flops": work,
            "tokens_per_sec_per_chip": per_chip,
            "mfu": self.model_flops_per_token * per_chip / self.peak_flops,
            "bound": "compute" if compute >= memory else "memory"}

  def as_dict(self) -> dict[str, Any]:
    model_flops = self.model_flops_per_token * self.tokens_per_step / self.devices
    return {
        "chips": self.devices, "device_kind": self.device_kind,
        "hbm_per_chip_bytes": self.hbm_per_chip_bytes,
        "bytes": self.train.memory.as_dict(),
        "eval_bytes": self.eval.memory.as_dict() if self.eval else None,
        "fits": self.fits,
        "mosaic_kernels": self.mosaic_kernels,
        "flops_per_step": self.flops_per_step, "bytes_per_step": self.bytes_per_step,
        "xla_flops_per_step": self.xla_flops, "xla_bytes_per_step": self.xla_bytes,
        "loops_without_trip_count": self.unknown_loops,
        "model_flops_per_step": model_flops,
        "model_flops_per_token": self.model_flops_per_token,
        "tokens_per_step": self.tokens_per_step,
        "roofline": self.roofline(),
        "compile_s": self.compile_s or sum(p.compile_s for p in self.programs),
        "mesh": self.mesh, "zero": self.zero, "remat": self.remat,
        "grad_accum_steps": self.accum_steps, "micro_batch": self.micro_batch_rows,
        "seq_len": self.seq_len, "parameters": self.parameters,
        "errors": [p.error for p in self.programs if p.error] or None,
    }


def compile_step(config: ml_collections.ConfigDict, devices, *, with_eval: bool = True,
                 hbm_bytes: int | None = None, analyse: bool = True, plan=None) -> StepReport:
  """Compiles ``train.run``'s training step (and evaluation step) for ``config`` on
  ``devices`` (real or compile-only) without allocating anything.

  ``config`` must be valid for these devices (:func:`validate`). ``hbm_bytes`` overrides the
  per-device capacity the report is judged against (default: :func:`device_memory`).
  ``analyse=False`` skips the FLOPs/bytes count of the HLO text (a fit check needs memory only).
  ``plan``: ``train.setup(config, devices)`` when the caller has it already.
  """
  from recurrentgemma_jax import train  # pylint: disable=g-import-not-at-top
  devices = list(devices)
  plan = plan or train.setup(config, devices)
  mesh = plan.mesh
  accum = config.optimizer.grad_accum_steps
  cfg = plan.model_cfg
  device = devices[0]
  chip = chip_of(device)
  report = StepReport(
      devices=len(devices), device_kind=device.device_kind, mesh=dict(mesh.shape),
      zero=config.zero, remat=cfg.remat, accum_steps=accum,
      micro_batch_rows=config.batch_size // accum // mesh.shape["data"],
      seq_len=config.seq_len, tokens_per_step=config.batch_size * config.seq_len,
      parameters=sum(x.size for x in jax.tree.leaves(plan.params_abstract)),
      model_flops_per_token=flops.train_flops_per_token(cfg, config.seq_len),
      hbm_per_chip_bytes=hbm_bytes or device_memory(device),
      train=Program(None, Memory(), 0.0),
      peak_flops=flops.device_peak_flops(device),
      hbm_bandwidth=chip.hbm_bandwidth if chip else None, unsplit_note=plan.unsplit_note)
  batch = abstract_batch(config, plan.batch_sharding)
  lowered = [plan.jit_train_step(accum).lower(plan.abstract_state, batch)]
  if with_eval:
    lowered.append(_lower_eval(config, plan))
  started = time.perf_counter()
  # The two compiles run side by side (XLA releases the GIL while it compiles).
  with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
    programs = list(pool.map(_compile, lowered))
  report.compile_s = time.perf_counter() - started
  report.train = programs[0]
  report.eval = programs[1] if with_eval else None
  if analyse:
    analyse_step(report)
  return report


def analyse_step(report: StepReport) -> None:
  """Fills in the compiled training step's FLOPs, bytes and Mosaic kernels."""
  compiled = report.train.compiled
  if compiled is None:
    return
  text = compiled.as_text()
  report.mosaic_kernels = text.count('custom_call_target="tpu_custom_call"')
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report.xla_flops = float(cost.get("flops", 0.0))
  report.xla_bytes = float(cost.get("bytes accessed", 0.0))
  counted, report.unknown_loops = hlo_cost.loop_corrected(text, report.xla_flops,
                                                          report.xla_bytes)
  report.flops_per_step, report.bytes_per_step = counted.flops, counted.bytes


def _lower_eval(config: ml_collections.ConfigDict, plan):
  eval_len = config.seq_len
  if config.data.source == "synthetic" and config.data.synthetic.eval_seq_len:
    eval_len = config.data.synthetic.eval_seq_len
  batch = abstract_batch(config, plan.batch_sharding, seq_len=eval_len)
  return plan.jit_eval_step().lower(plan.abstract_state["params"], batch)


def compile_eval(config: ml_collections.ConfigDict, plan) -> Program:
  """``train.run``'s evaluation step for ``config`` on ``plan`` (``train.setup``'s)."""
  return _compile(_lower_eval(config, plan))


# -- searching ---------------------------------------------------------------------------------

REMAT_ORDER = ("none", "dots", "block")  # cheapest (no recomputation) first


@dataclasses.dataclass
class SearchResult:
  report: StepReport | None   # the chosen setting's (None: nothing fits)
  remat: str | None
  accum_steps: int | None
  compiles: int
  tried: list[tuple[str, int, bool]]  # (remat, accum, fits) in the order compiled


def accum_candidates(config: ml_collections.ConfigDict, devices) -> list[int]:
  """Gradient-accumulation steps that split the rows of each data shard evenly and that the
  run accepts, fewest (largest micro-batch) first."""
  model = config.mesh.model if config.mesh.model != -1 else len(devices) // config.mesh.data
  data = len(devices) // model
  rows = config.batch_size // data
  out = []
  for accum in range(1, rows + 1):
    if rows % accum:
      continue
    trial = ml_collections.ConfigDict(config.to_dict())
    trial.optimizer.grad_accum_steps = accum
    try:
      validate(trial, devices)
    except ConfigError:
      continue
    out.append(accum)
  return out


def search(config: ml_collections.ConfigDict, devices, *, hbm_bytes: int | None = None,
           log=lambda _: None) -> SearchResult:
  """The cheapest remat policy (``REMAT_ORDER``) under which the step fits, and with it the
  largest micro-batch (fewest accumulation steps) that fits, by compiling candidates: per
  policy, the smallest micro-batch first (if even that does not fit, the next policy), then a
  bisection over the accumulation steps. ``config.batch_size`` is kept. Raises CompileError
  when a candidate fails to compile for another reason than its size."""
  candidates = accum_candidates(config, devices)
  tried: list[tuple[str, int, bool]] = []
  fitting: dict[tuple[str, int], StepReport] = {}  # the last that fit (bisection's upper end)

  def fits(remat: str, accum: int) -> bool:
    trial = ml_collections.ConfigDict(config.to_dict())
    trial.model.remat, trial.optimizer.grad_accum_steps = remat, accum
    report = compile_step(trial, devices, with_eval=False, hbm_bytes=hbm_bytes, analyse=False)
    if report.train.compiled is None and not report.train.out_of_memory:
      raise CompileError(f"remat={remat} grad_accum_steps={accum} did not compile: "
                         f"{report.train.error}")
    ok = report.fits
    tried.append((remat, accum, ok))
    if ok:
      fitting.clear()
      fitting[(remat, accum)] = report
    log(f"  remat={remat} grad_accum_steps={accum}: "
        f"{human_bytes(report.worst.memory.total)} per chip, "
        f"{'fits' if ok else 'does not fit'}")
    return ok

  for remat in REMAT_ORDER:
    if not candidates or not fits(remat, candidates[-1]):
      continue
    lo, hi = 0, len(candidates) - 1  # candidates[hi] fits; find the first that does
    while lo < hi:
      mid = (lo + hi) // 2
      if fits(remat, candidates[mid]):
        hi = mid
      else:
        lo = mid + 1
    chosen = fitting[(remat, candidates[hi])]
    analyse_step(chosen)
    return SearchResult(chosen, remat, candidates[hi], len(tried), tried)
  return SearchResult(None, None, None, len(tried), tried)


# -- the fit check before a run allocates anything ---------------------------------------------

def state_bytes_per_device(abstract_state) -> int:
  """Bytes of a train state (ShapeDtypeStructs with shardings) on its busiest device."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(abstract_state))


def fit_check(config: ml_collections.ConfigDict, plan, *, log=lambda _: None) -> StepReport:
  """Compiles ``train.run``'s training and evaluation steps for ``plan`` (``train.setup``'s;
  nothing allocated) and returns the report, whose compiled programs the run then uses. The
  limit per device (the report's ``hbm_per_chip_bytes``) is ``config.memory_limit_gib``, or
  :func:`device_memory`. Raises ConfigError, one line, when the steps need more, naming what
  would fit as flags, found by compiling alternatives (``search``: remat and micro-batch; ZeRO 3
  over the data axis); when the parameters and optimizer state alone exceed the limit, says so
  without compiling."""
  devices = list(plan.mesh.devices.flat)
  limit = int(config.memory_limit_gib * GIB) or device_memory(plan.mesh.local_devices[0])
  state = state_bytes_per_device(plan.abstract_state)
  if limit is not None and state > limit:
    total = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(plan.abstract_state))
    raise ConfigError(
        f"does not fit: the parameters and optimizer state alone need {human_bytes(state)} per "
        f"device, {human_bytes(limit)} available; in all they take {human_bytes(total)}, so "
        f"they need --config.zero=3 over at least {math.ceil(total / limit)} such devices")
  report = compile_step(config, devices, hbm_bytes=limit, analyse=False, plan=plan)
  failed = [p for p in report.programs if p.compiled is None and not p.out_of_memory]
  if failed:
    raise CompileError(f"the step did not compile: {failed[0].error}")
  unsized = [p for p in report.programs if p.out_of_memory and p.memory.needed is None]
  if unsized:  # the device itself was out of memory while compiling (e.g. autotuning on a GPU)
    raise ConfigError(
        f"the step did not compile: the device ran out of memory while compiling "
        f"({unsized[0].error}); is another process holding it? (processes sharing a GPU need "
        f"XLA_PYTHON_CLIENT_PREALLOCATE=false)")
  if limit is None or report.fits:
    return report
  worst = report.worst
  if report.train.memory.total <= limit:  # evaluation runs whole batches: no remat, no micro-batch
    raise ConfigError(
        f"does not fit: the evaluation step needs {human_bytes(worst.memory.total)} per device, "
        f"{human_bytes(limit)} available (the training step "
        f"{human_bytes(report.train.memory.total)}): use a smaller batch_size")
  need = f"needs {human_bytes(worst.memory.total)} per device, {human_bytes(limit)} available"
  log(f"the step {need}; compiling alternatives to find one that fits")
  trials = [config]
  if config.zero != 3 and plan.mesh.shape["data"] > 1:
    zero3 = ml_collections.ConfigDict(config.to_dict())
    zero3.zero = 3
    trials.append(zero3)
  for trial in trials:
    found = search(trial, devices, hbm_bytes=limit)
    if found.report is not None:
      flags = (["--config.zero=3"] if trial is not config else []) + [
          f"--config.model.remat={found.remat}",
          f"--config.optimizer.grad_accum_steps={found.accum_steps}"]
      raise ConfigError(
          f"does not fit: the training step {need}: use {' '.join(flags)} (compiled: "
          f"{human_bytes(found.report.worst.memory.total)} per device)")
  raise ConfigError(
      f"does not fit: the training step {need}, and no remat policy or micro-batch (down to "
      f"one row per data shard) fits at batch_size={config.batch_size} on {len(devices)} "
      "devices: use more devices, a smaller model.seq_len or batch_size")


# -- the fit check of the other scripts' programs ----------------------------------------------

def memory_limit(limit_gib: float, device) -> int | None:
  """Bytes a program may take per device: ``limit_gib`` GiB when positive (a smaller device,
  simulated), otherwise :func:`device_memory` of ``device``."""
  return int(limit_gib * GIB) if limit_gib else device_memory(device)


def check_program(what: str, lower: Callable[[int], Any], value: int, *, flag: str,
                  limit: int | None, hint: str, log=lambda _: None) -> Program:
  """Compiles ``lower(value)`` and returns it, the program to run, when it fits in ``limit``
  bytes per device. ``lower(v)`` lowers the program with ``flag`` set to ``v`` (a batch size, a
  number of tokens) on abstract arguments: nothing is allocated. When it does not fit, raises
  ConfigError, one line: both figures and the largest of ``value // 2, value // 4, ..., 1`` that
  fits, found by compiling them (1 first; when even that does not fit, ``hint`` says what else
  to change). Raises CompileError when a program fails to compile for another reason."""

  def compile_at(v: int) -> Program:
    program = _compile(lower(v))
    if program.compiled is None and not program.out_of_memory:
      raise CompileError(f"{what} did not compile ({flag}={v}): {program.error}")
    return program

  program = compile_at(value)
  if program.fits(limit):
    return program
  need = (f"does not fit: {what} needs {human_bytes(program.memory.total)} per device, "
          f"{human_bytes(limit)} available")
  halvings = []
  v = value // 2
  while v >= 1:
    halvings.append(v)
    v //= 2
  if not halvings:
    raise ConfigError(f"{need}: {hint}")
  log(f"{need}; compiling smaller {flag} to find one that fits")
  smallest = compile_at(halvings[-1])
  if not smallest.fits(limit):
    raise ConfigError(f"{need}, and {flag}=1 needs {human_bytes(smallest.memory.total)}: {hint}")
  for v in halvings[:-1]:
    trial = compile_at(v)
    if trial.fits(limit):
      break
  else:
    v, trial = halvings[-1], smallest
  raise ConfigError(f"{need}: use {flag}={v} (compiled: {human_bytes(trial.memory.total)} "
                    "per device)")


@dataclasses.dataclass
class CheckpointModel:
  """The model of a checkpoint, abstract (no parameter read yet): what its programs are
  compiled for before the parameters are restored (:meth:`restore`) onto ``sharding``."""

  path: str          # the model directory
  cfg: Any           # model.ModelConfig
  meta: dict         # the checkpoint's model config as saved (names the tokenizer)
  graphdef: Any
  state: Any         # nnx.State of ShapeDtypeStructs placed with ``sharding``
  sharding: jax.sharding.Sharding
  # ``path`` and, for a training workdir, its older steps: what a damaged step falls back to
  dirs: list = dataclasses.field(default_factory=list)

  def restore(self):
    """The parameters, read from the checkpoint and placed as ``state`` says; a workdir's step
    that cannot be read gives way to the one before it, with a warning line on stderr
    (``checkpoint.restore_newest``)."""
    from recurrentgemma_jax import checkpoint  # pylint: disable=g-import-not-at-top
    shardings = jax.tree.map(lambda _: self.sharding, self.state)
    params, self.path = checkpoint.restore_newest(self.dirs or [self.path], self.state,
                                                  shardings, cfg=self.cfg)
    return params


def checkpoint_model(path: str, device, **overrides) -> CheckpointModel:
  """The model of the checkpoint (or workdir: its newest step whose config reads) at ``path``
  built abstractly from its model config, with this machine's kernel choices
  (``checkpoint.portable``: a checkpoint trained with a GPU's kernels runs on a CPU),
  ``overrides`` replacing fields that keep the parameter shapes (``dtype``), its parameters to
  be placed on ``device``. Reads the model config only."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import checkpoint, model  # pylint: disable=g-import-not-at-top
  dirs, cfg, meta = checkpoint.newest_readable_config(path)
  cfg = dataclasses.replace(checkpoint.portable(cfg), **overrides)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: model.init_model(cfg)))
  sharding = jax.sharding.SingleDeviceSharding(device)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                       state)
  return CheckpointModel(dirs[0], cfg, meta, graphdef, state, sharding, dirs)


# -- decoding on one chip ------------------------------------------------------------------------


def compile_sampling(model_cfg, device, batch: int, new_tokens: int) -> Program:
  """Compiles ``sampling.sample`` for ``batch`` one-token prompts and ``new_tokens`` greedy
  tokens on ``device`` (real or compile-only: abstract weights, nothing is allocated), the
  weights replicated, as in serving one model copy per chip."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib, sampling  # pylint: disable=g-import-not-at-top
  from sharding import partitioning  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.asarray([device]).reshape(1, 1),
                           (partitioning.DATA, partitioning.MODEL))
  replicated = NamedSharding(mesh, PartitionSpec())
  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.init_model(model_cfg, seed=0)))
    state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), state)
    lowered, _ = sampling.lower_sample(graphdef, state, [[3]] * batch,
                                       sampling.SamplingParams(max_new_tokens=new_tokens))
    return _compile(lowered)
