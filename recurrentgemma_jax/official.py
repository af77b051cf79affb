"""Official RecurrentGemma Flax parameters -> this package's model.

The official tree names blocks ``"blocks.{i}"``; everything below a block already has the
official names here (see ``layers.py``), so the conversion renames the block keys and reads
the architecture off the parameter shapes.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax.errors import CheckpointError

_BLOCK_KEY = re.compile(r"^blocks\.(\d+)$")


def _unwrap(tree: Mapping[str, Any]) -> Mapping[str, Any]:
  return tree["params"] if set(tree) == {"params"} else tree


def infer_config(tree: Mapping[str, Any], *, attention_window_size: int = 2048,
                 logits_soft_cap: float = 30.0, embeddings_scale_by_sqrt_dim: bool = True,
                 **fields) -> model_lib.ModelConfig:
  """Width, LRU width, MLP width, heads, gate blocks and block pattern from shapes."""
  params = _unwrap(tree)
  try:
    vocab_size, width = np.shape(params["embedder"]["input_embedding"])
    num_layers = sum(1 for k in params if _BLOCK_KEY.match(k))
    mlp_width = np.shape(params["blocks.0"]["mlp_block"]["ffw_up"]["w"])[-1]
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"not a RecurrentGemma parameter tree (missing {e})") from None
  block_types, lru_width, gate_blocks, num_heads = [], None, None, None
  for i in range(num_layers):
    block = params.get(f"blocks.{i}")
    if block is None:
      raise CheckpointError(f"parameter tree has no 'blocks.{i}' but has later blocks")
    if "recurrent_block" in block:
      block_types.append("recurrent")
      gate_blocks, per_block, _ = np.shape(block["recurrent_block"]["rg_lru"]["a_gate"]["w"])
      lru_width = gate_blocks * per_block
    elif "attention_block" in block:
      block_types.append("attention")
      num_heads = width // np.shape(block["attention_block"]["proj_k"]["kernel"])[1]
    else:
      raise CheckpointError(f"blocks.{i} has neither a recurrent nor an attention block "
                            f"(keys: {sorted(block)})")
  embedding_dtype = np.dtype(getattr(params["embedder"]["input_embedding"], "dtype", "float32"))
  fields.setdefault("param_dtype", "bfloat16" if embedding_dtype.name == "bfloat16" else "float32")
  # ``convert_params`` writes the canonical per-layer tree; a scanned model stacks it on loading.
  fields.setdefault("scan_layers", False)
  return model_lib.ModelConfig(
      family="griffin" if "attention" in block_types else "hawk",
      vocab_size=int(vocab_size), width=int(width), num_layers=num_layers,
      num_heads=int(num_heads or gate_blocks), lru_width=lru_width,
      mlp_expanded_width=int(mlp_width), num_gate_blocks=gate_blocks,
      attention_window_size=attention_window_size, logits_soft_cap=logits_soft_cap,
      embeddings_scale_by_sqrt_dim=embeddings_scale_by_sqrt_dim,
      block_types=tuple(block_types), **fields)


def convert_params(tree: Mapping[str, Any]) -> dict[str, Any]:
  """The official tree with ``blocks.{i}`` turned into ``blocks[i]`` (our NNX paths)."""
  params = _unwrap(tree)
  out: dict[str, Any] = {"blocks": {}}
  for key, value in params.items():
    match = _BLOCK_KEY.match(key)
    if match:
      out["blocks"][int(match.group(1))] = value
    else:
      out[key] = value
  return out
