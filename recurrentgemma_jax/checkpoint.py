"""Model checkpoints: an Orbax composite directory with two items.

- ``params``: the parameter tree (a nested dict of arrays, paths as in the model);
- ``model_config``: the ``ModelConfig`` fields as JSON (plus the tokenizer the model was
  trained with, when known).

The importer writes exactly this; a training step directory (``WORKDIR/checkpoints/N``) has
the same two items beside the optimizer state and the data position, so every script loads
either with :func:`load_model`.

The parameter tree's layer layout follows the config's ``scan_layers`` (absent in checkpoints
written before it: per layer, as the importer still writes); restoring into a model of the
other layout converts the tree (:func:`relayout`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax.errors import CheckpointError, first_line

PARAMS = "params"
MODEL_CONFIG = "model_config"


def save_model(path: str, params: dict, cfg: model_lib.ModelConfig, *,
               tokenizer: str | None = None) -> None:
  """Writes ``params`` and the config to ``path`` (which must not exist yet)."""
  meta = dataclasses.asdict(cfg)
  meta["tokenizer"] = tokenizer
  ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  ckptr.save(os.path.abspath(path), ocp.args.Composite(
      **{PARAMS: ocp.args.StandardSave(params), MODEL_CONFIG: ocp.args.JsonSave(meta)}))


def _is_model_dir(path: str) -> bool:
  return all(os.path.isdir(os.path.join(path, item)) for item in (PARAMS, MODEL_CONFIG))


def resolve_model_dir(path: str) -> str:
  """A model directory from a model directory, a training workdir or its ``checkpoints/``."""
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint {path!r} does not exist")
  if _is_model_dir(path):
    return path
  ckpt_dir = os.path.join(path, "checkpoints") if os.path.isdir(
      os.path.join(path, "checkpoints")) else path
  for step in committed_steps(ckpt_dir):
    candidate = os.path.join(ckpt_dir, str(step))
    if _is_model_dir(candidate):
      return candidate
  raise CheckpointError(
      f"checkpoint {path!r} has no '{PARAMS}' and '{MODEL_CONFIG}' items (expected a directory "
      "written by scripts/import_recurrentgemma.py or a training workdir)")


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
    raise CheckpointError(f"checkpoint {path!r}: cannot restore '{PARAMS}': "
                          f"{first_line(e)}") from None
  if saved_cfg.layers_scanned != cfg.layers_scanned:
    placed = {} if shardings is None else {"out_shardings": shardings}
    restored = jax.jit(lambda tree: relayout(tree, saved_cfg, cfg), **placed)(restored)
  return state_from_pure_dict(params_abstract, restored)


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
  """Builds the model of a checkpoint and restores its parameters.

  ``overrides`` replace config fields that do not change parameter shapes (``dtype``,
  ``scan_impl``, ``attention_window_size``, ``scan_layers``, ...).
  """
  path = resolve_model_dir(os.path.abspath(path))
  cfg, meta = read_model_config(path)
  cfg = dataclasses.replace(cfg, **overrides)
  graphdef, params_abstract = nnx.split(nnx.eval_shape(lambda: model_lib.init_model(cfg)))
  return nnx.merge(graphdef, restore_params(path, params_abstract, cfg=cfg)), meta
