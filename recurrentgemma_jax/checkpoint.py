"""Model checkpoints: an Orbax composite directory with two items.

- ``params``: the parameter tree (a nested dict of arrays, paths as in the model);
- ``model_config``: the ``ModelConfig`` fields as JSON (plus the tokenizer the model was
  trained with, when known).

The importer writes exactly this; a training step directory (``WORKDIR/checkpoints/N``) has
the same two items beside the optimizer state and the data position, so every script loads
either with :func:`load_model`.

A path given to a script may also be a training workdir: its newest step is loaded
(:func:`model_dirs`), and the one before when the newest cannot be read
(:func:`restore_newest`); the kernel choices are the loading machine's (:func:`portable`).

The parameter tree's layer layout follows the config's ``scan_layers`` (absent in checkpoints
written before it: per layer, as the importer still writes); restoring into a model of the
other layout converts the tree (:func:`relayout`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from flax import nnx

from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax import errors
from recurrentgemma_jax.errors import CheckpointError, first_line

PARAMS = "params"
MODEL_CONFIG = "model_config"


TOKENIZER = "tokenizer.model"  # a SentencePiece tokenizer's copy in a model directory


def save_model(path: str, params: dict, cfg: model_lib.ModelConfig, *,
               tokenizer: str | None = None) -> None:
  """Writes ``params`` and the config to ``path`` (which must not exist yet). ``tokenizer``:
  ``"byte"``, None, or a SentencePiece file, which is copied into ``path`` as
  ``tokenizer.model`` and recorded by that copy's absolute path: the checkpoint then samples
  from any directory, whatever the path was relative to."""
  if tokenizer not in (None, "byte") and not os.path.isfile(tokenizer):
    raise CheckpointError(f"tokenizer {tokenizer!r} is not a file")
  path = os.path.abspath(path)
  meta = dataclasses.asdict(cfg)
  meta["tokenizer"] = tokenizer if tokenizer in (None, "byte") else os.path.join(path, TOKENIZER)
  ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  ckptr.save(path, ocp.args.Composite(
      **{PARAMS: ocp.args.StandardSave(params), MODEL_CONFIG: ocp.args.JsonSave(meta)}))
  if meta["tokenizer"] not in (None, "byte"):
    shutil.copyfile(tokenizer, meta["tokenizer"])


def is_model_dir(path: str) -> bool:
  return all(os.path.isdir(os.path.join(path, item)) for item in (PARAMS, MODEL_CONFIG))


def is_ours(path: str) -> bool:
  """Whether ``path`` is one of this package's model directories or training workdirs."""
  return is_model_dir(path) or bool(_workdir_steps(path))


def _workdir_steps(path: str) -> list[str]:
  ckpt_dir = os.path.join(path, "checkpoints") if os.path.isdir(
      os.path.join(path, "checkpoints")) else path
  return [os.path.join(ckpt_dir, str(step)) for step in committed_steps(ckpt_dir)
          if is_model_dir(os.path.join(ckpt_dir, str(step)))]


# What a bare Orbax tree (the official RecurrentGemma checkpoints) holds at its top.
_ORBAX_TREE_FILES = ("_METADATA", "manifest.ocdbt", "checkpoint")


def _not_ours(path: str) -> str:
  importer = f"import it first: python3 scripts/import_recurrentgemma.py --src {path} --dst OUT"
  if os.path.isfile(os.path.join(path, "config.json")):
    return f"checkpoint {path!r} is a transformers directory, not ours; {importer}"
  if any(os.path.exists(os.path.join(path, f)) for f in _ORBAX_TREE_FILES):
    return (f"checkpoint {path!r} is a bare Orbax parameter tree (an official RecurrentGemma "
            f"checkpoint?), not ours; {importer}")
  if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(
      os.path.join(path, "metrics.jsonl")):
    return (f"checkpoint {path!r} is a training workdir with no checkpoint yet (the first is "
            "written at step checkpoint_every, or when a SIGTERM or Ctrl-C stops the run)")
  if not os.path.isdir(path):
    return (f"checkpoint {path!r} is a file; expected a directory written by "
            "scripts/import_recurrentgemma.py or a training workdir")
  return (f"checkpoint {path!r} has no '{PARAMS}' and '{MODEL_CONFIG}' items (expected a "
          "directory written by scripts/import_recurrentgemma.py or a training workdir)")


def model_dirs(path: str) -> list[str]:
  """The model directories ``path`` names, the one to use first: a training workdir's (or its
  ``checkpoints/``') committed steps, newest first, else ``path`` itself. Where a directory is
  both a model directory and a workdir (trained with it as ``--workdir``), its newest step
  wins: the model at its top is the older."""
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint {path!r} does not exist")
  steps = _workdir_steps(path)
  if steps:
    return steps
  if is_model_dir(path):
    return [path]
  raise CheckpointError(_not_ours(path))


def resolve_model_dir(path: str) -> str:
  """A model directory from a model directory, a training workdir or its ``checkpoints/``
  (the newest step: :func:`model_dirs`)."""
  return model_dirs(path)[0]


def warn(line: str) -> None:
  """A warning line on stderr (stdout may carry a script's output)."""
  print(line, file=sys.stderr, flush=True)


def newest_readable_config(path: str, warn: Callable[[str], None] = warn
                           ) -> tuple[list[str], model_lib.ModelConfig, dict[str, Any]]:
  """``(model directories, config, raw JSON)``: of the model directories ``path`` names
  (:func:`model_dirs`), the first whose model config reads, and the older ones after it (what
  :func:`restore_newest` may fall back to). A workdir's step whose config cannot be read is
  skipped with a ``warn`` line; the last one's error is raised."""
  dirs = model_dirs(os.path.abspath(path))
  for i, candidate in enumerate(dirs):
    try:
      cfg, meta = read_model_config(candidate)
    except CheckpointError as e:
      if i + 1 == len(dirs):
        raise
      warn(f"warning: {e}; using the step before it, {os.path.basename(dirs[i + 1])}")
      continue
    return dirs[i:], cfg, meta
  raise AssertionError("unreachable")  # (model_dirs returns at least one)


def restore_newest(dirs: list[str], params_abstract: nnx.State, shardings=None, *,
                   cfg: model_lib.ModelConfig | None = None,
                   warn: Callable[[str], None] = warn) -> tuple[nnx.State, str]:
  """``(restore_params of dirs[0], dirs[0])``, or, when its parameters cannot be read (a step
  damaged on disk), of the next of ``dirs`` that can (a training workdir's older steps, from
  :func:`newest_readable_config`), with a ``warn`` line per step skipped. Nothing is moved:
  training sets a damaged step aside when it resumes. The last one's error is raised."""
  for i, candidate in enumerate(dirs):
    try:
      return restore_params(candidate, params_abstract, shardings, cfg=cfg), candidate
    except CheckpointError as e:
      if i + 1 == len(dirs):
        raise
      warn(f"warning: {e}; using the step before it, {os.path.basename(dirs[i + 1])}")
  raise AssertionError("unreachable")  # (dirs is not empty)


# ModelConfig fields that choose how a model runs on one platform (a kernel, cuDNN) and
# change no parameter: a checkpoint trained on GPUs with attention_impl=cudnn would not run
# on a CPU or TPU. Loading a checkpoint for evaluation, sampling or export sets them to
# auto, which picks what the machine it runs on has.
PLATFORM_FIELDS = ("scan_impl", "attention_impl", "fused_rg_lru", "gate_impl", "mlp_impl",
                   "conv1d_impl", "norm_impl", "decode_impl", "loss_impl")


def portable(cfg: model_lib.ModelConfig) -> model_lib.ModelConfig:
  """``cfg`` with every :data:`PLATFORM_FIELDS` field ``auto``."""
  return dataclasses.replace(cfg, **{name: "auto" for name in PLATFORM_FIELDS})


def read_json_item(path: str, item: str) -> dict[str, Any]:
  """The JSON of item ``item`` of the checkpoint directory ``path`` (``model_config``, or a
  training step's ``meta`` and ``data``); a CheckpointError if missing or unreadable."""
  item_dir = os.path.join(path, item)
  # (Orbax names the JSON "metadata"; a training step's items also hold commit_success.txt.)
  files = sorted((f for f in os.listdir(item_dir)
                  if not f.startswith("_") and f != "commit_success.txt"),
                 key=lambda f: f != "metadata") if os.path.isdir(item_dir) else []
  if not files:
    raise CheckpointError(f"checkpoint {path!r}: '{item}' is empty")
  try:
    with open(os.path.join(item_dir, files[0])) as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"checkpoint {path!r}: cannot read '{item}': {e}") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"checkpoint {path!r}: '{item}' is not a JSON object")
  return value


def read_model_config(path: str) -> tuple[model_lib.ModelConfig, dict[str, Any]]:
  """The model config and the raw JSON (which also names the tokenizer)."""
  meta = read_json_item(path, MODEL_CONFIG)
  copy = os.path.join(path, TOKENIZER)  # save_model's copy: found again after a move
  if (meta.get("tokenizer") not in (None, "byte") and not os.path.isfile(meta["tokenizer"])
      and os.path.isfile(copy)):
    meta["tokenizer"] = copy
  try:
    # (Written before model.scan_layers existed: one entry per layer.)
    return model_lib.ModelConfig.from_dict({"scan_layers": False} | meta), meta
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"checkpoint {path!r}: cannot read '{MODEL_CONFIG}': {e}") from None


def committed_steps(directory: str) -> list[int]:
  """The steps of ``directory`` (a workdir's ``checkpoints/``) that Orbax committed, newest
  first (an interrupted save is a temporary directory with another name)."""
  if not os.path.isdir(directory):
    return []
  return sorted((int(name) for name in os.listdir(directory) if name.isdigit()), reverse=True)


def _param_shapes(cfg: model_lib.ModelConfig) -> dict[str, tuple[int, ...]]:
  cfg = dataclasses.replace(cfg, scan_layers=False)  # either layout restores (relayout)
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.init_model(cfg)), nnx.Param)
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))[0]
  return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in leaves}


def shape_difference(saved: model_lib.ModelConfig, ours: model_lib.ModelConfig
                     ) -> tuple[str, Any, Any] | None:
  """``(field, saved value, our value)`` of the first ``ModelConfig`` field that makes the
  parameter trees of the two configs differ (names or shapes); None when they agree. Fields
  that do not change shapes (dtype, kernels, window, remat, layer layout) never count."""
  reference = _param_shapes(saved)
  if reference == _param_shapes(ours):
    return None
  for field in dataclasses.fields(model_lib.ModelConfig):
    a, b = getattr(saved, field.name), getattr(ours, field.name)
    if a == b:
      continue
    try:
      changes = _param_shapes(dataclasses.replace(saved, **{field.name: b})) != reference
    except Exception:  # pylint: disable=broad-except  (inconsistent alone: it is a shape field)
      changes = True
    if changes:
      return field.name, a, b
  return "parameter shapes", "", ""


def restore_params(path: str, params_abstract: nnx.State, shardings=None, *,
                   cfg: model_lib.ModelConfig | None = None) -> nnx.State:
  """The ``params`` item of a model checkpoint, into the structure of ``params_abstract``
  (optionally placed with ``shardings``, a State of Shardings of the same structure), the
  layer layout of ``cfg`` (None: the checkpoint's own)."""
  path = resolve_model_dir(os.path.abspath(path))
  saved_cfg, _ = read_model_config(path)
  cfg = cfg or saved_cfg
  shardings = nnx.to_pure_dict(shardings) if shardings is not None else None
  target = nnx.to_pure_dict(params_abstract)
  target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target,
      shardings if shardings is not None else jax.tree.map(lambda _: None, target))
  ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  try:
    restored = ckptr.restore(path, ocp.args.Composite(
        **{PARAMS: ocp.args.StandardRestore(relayout(target, cfg, saved_cfg))}))[PARAMS]
  except Exception as e:  # Orbax raises many types for a damaged or mismatched tree.
    errors.UNREADABLE.add(os.path.abspath(path))
    raise CheckpointError(f"checkpoint {path!r}: cannot restore '{PARAMS}': "
                          f"{first_line(_innermost(e))}") from None
  if saved_cfg.layers_scanned != cfg.layers_scanned:
    placed = {} if shardings is None else {"out_shardings": shardings}
    restored = jax.jit(lambda tree: relayout(tree, saved_cfg, cfg), **placed)(restored)
  return state_from_pure_dict(params_abstract, restored)


def _innermost(e: BaseException) -> BaseException:
  """The exception at the bottom of ``e``'s causes: for a damaged file, TensorStore's reason
  (``OUT_OF_RANGE: Error reading ...``) where Orbax's own message is a page of its spec."""
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ or e.__context__
  return e


def relayout(tree, from_cfg: model_lib.ModelConfig, to_cfg: model_lib.ModelConfig):
  """``tree`` from ``from_cfg``'s layer layout to ``to_cfg``'s (``model.scan_layers``:
  ``model.stack_layers`` / ``unstack_layers``); the same tree when they agree.

  ``tree`` is a parameter tree as saved (a nested dict) or any pytree whose parameter-shaped
  parts are States (a parameter State; an optimizer state, whose moments are). Leaves are
  arrays (stacked or sliced: jit this to place them) or ShapeDtypeStructs (restore targets,
  shardings included).
  """
  if from_cfg.layers_scanned == to_cfg.layers_scanned:
    return tree
  convert = model_lib.stack_layers if to_cfg.layers_scanned else model_lib.unstack_layers
  if not isinstance(tree, nnx.State) and isinstance(tree, dict):
    return convert(tree, to_cfg)
  like = nnx.state(nnx.eval_shape(lambda: model_lib.init_model(to_cfg)))
  return jax.tree.map(
      lambda x: state_from_pure_dict(like, convert(nnx.to_pure_dict(x), to_cfg))
      if isinstance(x, nnx.State) else x, tree, is_leaf=lambda x: isinstance(x, nnx.State))


def state_from_pure_dict(like: nnx.State, pure: dict) -> nnx.State:
  """A parameter State shaped like ``like`` holding the arrays of the nested dict ``pure``
  (the form parameters are saved in)."""
  state = jax.tree.map(lambda x: x, like)  # a copy: replace_by_pure_dict works in place
  nnx.replace_by_pure_dict(state, pure)
  return state


def load_model(path: str, **overrides) -> tuple[model_lib.Model, dict[str, Any]]:
  """Builds the model of a checkpoint and restores its parameters (a workdir: its newest
  readable step, :func:`restore_newest`).

  The kernel choices are this machine's (:func:`portable`); ``overrides`` replace config
  fields that do not change parameter shapes (``dtype``, ``scan_impl``,
  ``attention_window_size``, ``scan_layers``, ...).
  """
  dirs, cfg, meta = newest_readable_config(path)
  cfg = dataclasses.replace(portable(cfg), **overrides)
  graphdef, params_abstract = nnx.split(nnx.eval_shape(lambda: model_lib.init_model(cfg)))
  params, _ = restore_newest(dirs, params_abstract, cfg=cfg)
  return nnx.merge(graphdef, params), meta
