"""Run configs: the base every ``configs/*.py`` file starts from, loading a config file with
its ``:ARG``, ``--config.FIELD=VALUE`` overrides, and validation before anything compiles.

A config file defines ``get_config(arg=None) -> ml_collections.ConfigDict``. Every error here is
a :class:`ConfigError` with one line naming the field, the value and what is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
import os

import ml_collections

from recurrentgemma_jax import data
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import presets
from recurrentgemma_jax.errors import CheckpointError, ConfigError

SCHEDULES = ("cosine", "constant")


def base_config() -> ml_collections.ConfigDict:
  """Fields every config has, with their defaults (a small Griffin on the built-in corpus)."""
  c = ml_collections.ConfigDict()
  c.seed = 0                    # Parameter init and data order.
  c.total_steps = 1000          # Optimizer steps.
  c.batch_size = 16             # Global batch, in rows of seq_len tokens.
  c.seq_len = 256               # Tokens per row (documents are packed).
  c.log_every = 10              # Steps between metrics.jsonl lines.
  c.eval_every = 200            # Steps between held-out evaluations (0: only at the end).
  c.checkpoint_every = 200      # Steps between checkpoints (also at the end and on SIGTERM).
  c.keep_checkpoints = 3        # Most recent checkpoints kept.
  c.init_from = ""              # A model checkpoint to start from (fine-tuning), e.g. imported.
  c.zero = 0                    # 0: replicated, 1: optimizer state sharded over data, 3: params too.
  c.memory_limit_gib = 0.0      # Per-device memory the fit check allows (0: what the device has).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1              # Devices on the data axis (-1: the remaining devices).
  c.mesh.model = 1              # Devices on the model (tensor-parallel) axis (-1: the remaining).
  c.mesh.slices = 1             # TPU slices data spans over DCN (GPUs: equal process groups).
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 1e-3   # Peak learning rate.
  c.optimizer.warmup_steps = 100     # Linear warmup from 0.
  c.optimizer.schedule = "cosine"    # After warmup: cosine | constant.
  c.optimizer.final_lr_fraction = 0.1  # Cosine ends at this fraction of the peak.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1     # AdamW; never on norms, biases or the RG-LRU a_param.
  c.optimizer.decay_embeddings = False  # Whether the embedding table is decayed too.
  c.optimizer.grad_clip_norm = 1.0   # Global-norm clipping (0: off).
  c.optimizer.grad_accum_steps = 1   # Micro-batches per step (batch_size must divide by it).
  c.model = ml_collections.ConfigDict(_model_defaults())
  c.data = data.default_config()
  return c


def _model_defaults() -> dict:
  fields = {f.name: f.default for f in dataclasses.fields(model_lib.ModelConfig)}
  fields["vocab_size"] = 0  # 0: the tokenizer's vocabulary size.
  fields.update(presets.preset("griffin", "100m"))
  fields["block_types"] = ""  # Empty: from model.family; else comma-separated block types.
  fields["lru_width"] = 0      # 0: model.width.
  fields["mlp_expanded_width"] = 0  # 0: 3 * model.width.
  fields["num_gate_blocks"] = 0     # 0: model.num_heads.
  fields["gla_num_heads"] = 0       # 0: model.num_heads.
  return fields


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> model_lib.ModelConfig:
  """The ``ModelConfig`` of a run (zeros mean "derived", see ``_model_defaults``)."""
  fields = config.model.to_dict()
  for name in ("lru_width", "mlp_expanded_width", "num_gate_blocks", "gla_num_heads"):
    fields[name] = fields[name] or None
  blocks = fields["block_types"]
  fields["block_types"] = tuple(b.strip() for b in blocks.split(",")) if blocks else None
  fields["vocab_size"] = fields["vocab_size"] or vocab_size
  return model_lib.ModelConfig.from_dict(fields)


def load(spec: str) -> ml_collections.ConfigDict:
  """``path/to/config.py[:ARG]`` -> the ConfigDict of its ``get_config(ARG)``."""
  path, _, arg = spec.partition(":")
  if os.path.isdir(path):
    raise ConfigError(f"--config {path!r} is a directory; name a config file in it, e.g. "
                      f"{os.path.join(path, 'default.py')!r}")
  if not os.path.isfile(path):
    raise ConfigError(f"--config {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location(
      "config_" + os.path.basename(path).removesuffix(".py"), path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # A config file is user code: report its error in one line.
    raise ConfigError(f"--config {path!r} failed to load: {type(e).__name__}: {e}") from None
  if not hasattr(module, "get_config"):
    raise ConfigError(f"--config {path!r} defines no get_config(arg=None)")
  try:
    config = module.get_config(arg or None)
  except (KeyError, ValueError, ConfigError) as e:
    raise ConfigError(f"--config {spec!r}: {e.args[0] if e.args else e}") from None
  except Exception as e:  # pylint: disable=broad-except  (user code, e.g. c.modle.width)
    raise ConfigError(f"--config {spec!r}: get_config failed: {type(e).__name__}: {e}"
                      ) from None
  # A field the base does not have is a typo that would otherwise be silently unused.
  known = set(_all_fields(base_config()))
  unknown = sorted(set(_all_fields(config)) - known)
  if unknown:
    guess = difflib.get_close_matches(unknown[0], sorted(known), n=1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    more = f" and {len(unknown) - 1} more" if unknown[1:] else ""
    raise ConfigError(f"--config {spec!r} sets unknown field {unknown[0]!r}{hint}{more}")
  return config


def override(config: ml_collections.ConfigDict, assignments: list[str]) -> None:
  """Applies ``--config.FIELD=VALUE`` (or ``FIELD=VALUE``) in order; unknown fields are errors."""
  for item in assignments:
    key, sep, raw = item.removeprefix("--").removeprefix("config.").partition("=")
    if not sep and isinstance(_lookup(config, key), bool):
      sep, raw = "=", "true"  # --config.a.flag, as absl's boolean flags
    if not sep:
      raise ConfigError(f"override {item!r} is not of the form --config.FIELD=VALUE")
    parent, name = _resolve(config, key)
    old = parent[name]
    parent[name] = _parse(key, raw, old)


def _lookup(config, key: str):
  """The value of field ``key``, or None where there is no such field."""
  try:
    parent, name = _resolve(config, key)
  except ConfigError:
    return None
  return parent[name]


def canonical(config: ml_collections.ConfigDict, item: str) -> str:
  """An override ``item`` (already applied to ``config``) as ``--config.FIELD=VALUE`` with the
  value ``config`` holds, in the form ``ml_collections.config_flags`` parses the same way."""
  key = item.removeprefix("--").removeprefix("config.").partition("=")[0]
  value = _lookup(config, key)
  raw = str(value).lower() if isinstance(value, bool) else item.partition("=")[2]
  return f"--config.{key}={raw}"


def _resolve(config, key: str):
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      known = sorted(_all_fields(config))
      prefix = ".".join(parts[:i + 1])
      guess = difflib.get_close_matches(key, known, n=1)
      hint = f" (did you mean {guess[0]!r}?)" if guess else ""
      if key in _RENAMED:
        hint = f" ({_RENAMED[key]})"
      raise ConfigError(f"unknown config field {prefix!r} in --config.{key}{hint}")
    if i == len(parts) - 1:
      if isinstance(node[part], ml_collections.ConfigDict):
        raise ConfigError(f"--config.{key} is a group of fields; set one of its fields")
      return node, part
    node = node[part]


_RENAMED = {"data.eval_batches": "replaced by data.eval_tokens, the held-out tokens scored "
                                  "(rows x seq_len), the same whatever the batch size"}


def _all_fields(config, prefix=""):
  for k, v in config.items():
    if isinstance(v, ml_collections.ConfigDict):
      yield from _all_fields(v, f"{prefix}{k}.")
    else:
      yield prefix + k


def _parse(key: str, raw: str, old):
  """Parses ``raw`` as the type of the field's current value."""
  try:
    if isinstance(old, bool):
      lowered = raw.lower()
      if lowered not in _TRUE + _FALSE:
        raise ValueError
      return lowered in _TRUE
    if isinstance(old, int):
      return int(raw)
    if isinstance(old, float):
      return float(raw)
    if isinstance(old, str):
      return raw
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    kind = type(old).__name__
    allowed = f" ({'|'.join(_TRUE + _FALSE)})" if isinstance(old, bool) else ""
    raise ConfigError(f"--config.{key}={raw!r} is not a valid {kind}{allowed}") from None


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def validate(config: ml_collections.ConfigDict, *, process_count: int = 1,
             device_count: int = 1) -> None:
  """Raises one ConfigError listing every problem (one per line) before anything compiles."""
  errors = []

  def positive(name, value):
    if not isinstance(value, int) or value <= 0:
      errors.append(f"{name}={value!r} must be a positive integer")

  # (batch_size and seq_len are checked with the data fields)
  for name in ("total_steps", "log_every", "checkpoint_every", "keep_checkpoints"):
    positive(name, config[name])
  if not isinstance(config.seed, int) or not 0 <= config.seed < 2**32:
    errors.append(f"seed={config.seed!r} must be an integer in [0, 2**32)")
  if not isinstance(config.eval_every, int) or config.eval_every < 0:
    errors.append(f"eval_every={config.eval_every!r} must be >= 0 (0: only at the end)")
  if config.zero not in (0, 1, 3):
    errors.append(f"zero={config.zero!r} is not one of 0|1|3")
  if not 0 <= config.memory_limit_gib < math.inf:
    errors.append(f"memory_limit_gib={config.memory_limit_gib} must be >= 0 (0: the device's)")
  opt = config.optimizer
  # Written so that NaN fails them too (every comparison with NaN is false).
  if not 0 < opt.learning_rate < math.inf:
    errors.append(f"optimizer.learning_rate={opt.learning_rate} must be > 0")
  if not isinstance(opt.warmup_steps, int) or opt.warmup_steps < 0:
    errors.append(f"optimizer.warmup_steps={opt.warmup_steps!r} must be an integer >= 0")
  if opt.schedule not in SCHEDULES:
    errors.append(f"optimizer.schedule={opt.schedule!r} is not one of {'|'.join(SCHEDULES)}")
  if not 0 <= opt.final_lr_fraction <= 1:
    errors.append(f"optimizer.final_lr_fraction={opt.final_lr_fraction} must be in [0, 1]")
  for name in ("b1", "b2"):
    if not 0 <= opt[name] < 1:
      errors.append(f"optimizer.{name}={opt[name]} must be in [0, 1)")
  for name in ("eps", "weight_decay", "grad_clip_norm"):
    if not 0 <= opt[name] < math.inf:
      errors.append(f"optimizer.{name}={opt[name]} must be >= 0 and finite")
  positive("optimizer.grad_accum_steps", opt.grad_accum_steps)
  local_rows = config.batch_size // process_count if isinstance(config.batch_size, int) else 0
  if local_rows > 0 and opt.grad_accum_steps > 0 and local_rows % opt.grad_accum_steps:
    # (divisibility by the process count is checked with the data fields)
    errors.append(f"optimizer.grad_accum_steps={opt.grad_accum_steps} does not divide the "
                  f"{local_rows} rows per process of batch_size={config.batch_size}")
  errors += _mesh_errors(config.mesh, device_count)
  errors += data.validate(config, process_count=process_count)
  if not errors:  # (the batch over a valid mesh, once the batch and data fields are valid)
    errors += _data_axis_errors(config, device_count)
  if not errors:  # the model needs a valid tokenizer for its vocabulary size
    try:
      vocab = data.make_tokenizer(config).vocab_size
    except ConfigError as e:
      errors.append(str(e))
    else:
      cfg = model_config(config, vocab)
      errors += cfg.errors()
      if not errors and cfg.vocab_size < vocab:
        errors.append(f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
                      f"{vocab} ids")
      if not errors and cfg.attention_impl == "cudnn" and cfg.has_attention:
        errors += _cudnn_errors(cfg)
      if not errors and config.init_from:
        errors += _init_from_errors(config.init_from, cfg, config.data.tokenizer)
  if errors:
    raise ConfigError("\n".join(errors))


def _cudnn_errors(cfg: model_lib.ModelConfig) -> list[str]:
  problem = model_lib.cudnn_attention_problem(cfg.dtype, cfg.head_dim)
  return [f"model.attention_impl='cudnn' {problem} (use model.attention_impl=xla or auto)"] \
      if problem else []


def _init_from_errors(path: str, cfg: model_lib.ModelConfig, tokenizer: str = "byte"
                      ) -> list[str]:
  """``init_from`` must be a model checkpoint with this run's parameter shapes."""
  from recurrentgemma_jax import checkpoint  # pylint: disable=g-import-not-at-top
  if not os.path.exists(path):
    return [f"init_from={path!r} does not exist"]
  try:
    saved, meta = checkpoint.read_model_config(checkpoint.resolve_model_dir(path))
  except CheckpointError as e:
    return [f"init_from: {e}"]
  theirs = meta.get("tokenizer")
  if other_tokenizer_kind(theirs, tokenizer):
    return [f"init_from={path!r} was trained with the tokenizer {theirs!r} but this run has "
            f"data.tokenizer={tokenizer!r}; set --config.data.tokenizer={theirs}"]
  difference = checkpoint.shape_difference(saved, cfg)
  if difference:
    field, theirs, ours = difference
    return [f"init_from={path!r} has model.{field}={_show(theirs)} but this run has {_show(ours)}"]
  # Fields that keep the shapes but change what the weights compute: allowed (a deliberate
  # change), said once, since the defaults differ from an imported RecurrentGemma's.
  changed = [f"model.{name}={_show(getattr(saved, name))} -> {_show(getattr(cfg, name))}"
             for name in _FUNCTION_FIELDS if getattr(saved, name) != getattr(cfg, name)]
  if saved.resolved_block_types != cfg.resolved_block_types:
    changed.append("model.block_types (local and global attention)")
  if changed:
    data.sources.warn_once(
        f"init_from {path}", f"init_from={path!r} was trained with other settings that keep "
        f"its shapes, so its weights start as another model: {'; '.join(changed)}")
  return []


_FUNCTION_FIELDS = ("attention_window_size", "embeddings_scale_by_sqrt_dim", "logits_soft_cap")


def _show(value) -> str:
  return ",".join(value) if isinstance(value, tuple) else str(value)


def other_tokenizer_kind(recorded: str | None, tokenizer: str) -> bool:
  """Whether a checkpoint's recorded tokenizer and this run's ``data.tokenizer`` are of other
  kinds (byte-level against SentencePiece): the same shapes, the ids of another vocabulary."""
  return bool(recorded) and (recorded == "byte") != (tokenizer == "byte")


def _data_axis_size(mesh, device_count: int) -> int:
  return device_count // max(mesh.model, 1) if mesh.data == -1 else mesh.data


def _data_axis_errors(config: ml_collections.ConfigDict, device_count: int) -> list[str]:
  """The batch over the data axis of a valid mesh: whole rows per device, and whole rows per
  device in every micro-batch (else each device computes the whole micro-batch)."""
  if not isinstance(config.batch_size, int) or config.batch_size <= 0:
    return []  # (said above)
  data = _data_axis_size(config.mesh, device_count)
  if config.batch_size % data:
    return [f"batch_size={config.batch_size} is not divisible by the {data} devices on the "
            "data axis"]
  rows, accum = config.batch_size // data, config.optimizer.grad_accum_steps
  if isinstance(accum, int) and accum > 0 and rows % accum:
    return [f"optimizer.grad_accum_steps={accum} does not divide the {rows} rows per data "
            f"shard (batch_size={config.batch_size} over the {data} devices on the data axis)"]
  return []


def _mesh_errors(mesh, device_count: int) -> list[str]:
  sizes = {"data": mesh.data, "model": mesh.model}
  for name, size in sizes.items():
    if not isinstance(size, int) or (size <= 0 and size != -1):
      return [f"mesh.{name}={size!r} must be a positive integer or -1"]
  if mesh.data == -1 and mesh.model == -1:
    return ["mesh.data and mesh.model cannot both be -1"]
  fixed = max(mesh.data, 1) * max(mesh.model, 1)
  if device_count % fixed:
    return [f"the {device_count} devices do not split into mesh.data={mesh.data} x "
            f"mesh.model={mesh.model}"]
  if not isinstance(mesh.slices, int) or mesh.slices <= 0:
    return [f"mesh.slices={mesh.slices!r} must be a positive integer"]
  data = _data_axis_size(mesh, device_count)
  if data % mesh.slices:
    return [f"mesh.slices={mesh.slices} does not divide the data axis of {data} devices"]
  if -1 not in (mesh.data, mesh.model) and fixed != device_count:
    return [f"mesh.data={mesh.data} x mesh.model={mesh.model} = {fixed} but there are "
            f"{device_count} devices (use -1 for the remaining)"]
  return []


def family_config(family: str, size: str | None) -> ml_collections.ConfigDict:
  """A paper-size model of one family (``presets.py``) with a pre-training recipe for one
  accelerator host: bfloat16 compute, per-block rematerialisation, 2048-token rows; AdamW at the
  GLA paper's learning rates and weight decay for ``gla`` (3e-4 to 3e-5, 0.01)."""
  c = base_config()
  c.model.update(presets.preset(family, size or "100m"))  # KeyError names the sizes
  c.model.dtype = "bfloat16"
  c.model.remat = "block"
  c.total_steps = 10_000
  c.batch_size = 32
  c.seq_len = 2048
  c.data.eval_tokens = 524_288  # 256 held-out rows of 2048 tokens (the same for any batch_size)
  c.log_every = 50
  c.eval_every = 1000
  c.checkpoint_every = 1000
  c.optimizer.learning_rate = 1e-3 if size in (None, "100m", "200m", "400m", "340m") else 4e-4
  c.optimizer.warmup_steps = 1000
  if family == "gla":  # the GLA paper's recipe: peak 3e-4, cosine to 3e-5, weight decay 0.01
    c.optimizer.update(learning_rate=3e-4, final_lr_fraction=0.1, weight_decay=0.01)
  return c
