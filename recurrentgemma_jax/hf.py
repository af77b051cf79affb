"""HuggingFace transformers RecurrentGemma checkpoints <-> this package's checkpoints.

transformers' ``RecurrentGemmaForCausalLM`` keeps the official parameters under other names
and in torch layouts, in safetensors files (one ``model.safetensors``, or shards listed by
``model.safetensors.index.json``) beside a ``config.json``. This module holds the whole
mapping: ``config.json`` <-> ``ModelConfig`` (:func:`config_from_hf`, :func:`hf_config`),
tensor names and layouts <-> the per-layer parameter tree (:func:`tensor_table`), and the
reading and writing of safetensors files one tensor at a time.

Where transformers' model differs from ours (and the official one):

- Window: transformers' ``attention_window_size = W`` lets a query see the keys with
  ``q - k < W`` (W keys); ours, as the official model, ``q - k <= window`` (window + 1 keys).
  Importing sets ``window = W - 1``, exporting ``W = window + 1``: the same keys are seen.
- transformers always scales the embedding by ``sqrt(width)`` rounded to bfloat16, always caps
  the logits (``logits_soft_cap``), uses the tanh GeLU (``gelu_pytorch_tanh``), RoPE on half of
  each head (``partial_rotary_factor`` 0.5, wavelength 10000), RMSNorm epsilon 1e-6, and as
  many RG-LRU gate blocks as attention heads; its ``intermediate_size`` is both MLP branches
  (2 x ours). Its ``num_key_value_heads`` defaults to the number of heads; ours is always 1.
- transformers' Conv1D does not restart at a document start inside a row (``position_ids``
  0), ours does; its RG-LRU and ours both restart. Rows holding one document (what
  transformers is run on) give the same outputs; packed rows do not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
from typing import Any, Callable

import jax
import ml_dtypes  # registers bfloat16 with NumPy, which safetensors' NumPy reader needs
import numpy as np
from flax import nnx
from safetensors import safe_open

from recurrentgemma_jax import checkpoint
from recurrentgemma_jax import model as model_lib
from recurrentgemma_jax.errors import CheckpointError, first_line

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = checkpoint.TOKENIZER  # (the same name in both formats)
# Shards are split above this size (bytes), as ``save_pretrained(max_shard_size="5GB")``.
MAX_SHARD_BYTES = 5 * 10**9

ACTIVATION = "gelu_pytorch_tanh"
RMS_NORM_EPS = 1e-6
ROPE_THETA = 10000.0
PARTIAL_ROTARY_FACTOR = 0.5

# safetensors dtype codes of the dtypes parameters are read and written in.
_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
           "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}

# How one of our parameters becomes transformers tensors and back: ``(to_hf, from_hf)``,
# ``to_hf(ours) -> tuple of tensors`` (views where possible), ``from_hf(*tensors) -> ours``.
_LAYOUTS: dict[str, tuple[Callable, Callable]] = {
    # the same array
    "same": (lambda x: (x,), lambda x: x),
    # a Dense kernel [in, out] <-> a torch Linear weight [out, in]
    "linear": (lambda x: (x.T,), lambda w: w.T),
    # Conv1D taps [W, C] <-> a depthwise torch Conv1d weight [C, 1, W] (same tap order)
    "conv": (lambda x: (x.T[:, None, :],), lambda w: w[:, 0, :].T),
    # both MLP branches [2, D, M] <-> gate_proj (GeLU branch) and up_proj weights [M, D]
    "branch_linear": (lambda x: (x[0].T, x[1].T), lambda g, u: np.stack([g.T, u.T])),
    # both MLP branch biases [2, 1, 1, M] <-> gate_proj and up_proj biases [M]
    "branch_bias": (lambda x: (x[0, 0, 0], x[1, 0, 0]),
                    lambda g, u: np.stack([g, u])[:, None, None, :]),
}

# (our path below a block, transformers names below ``model.layers.N.``, layout)
_BLOCK_TENSORS = (
    ("temporal_pre_norm/scale", "temporal_pre_norm.weight", "same"),
    ("channel_pre_norm/scale", "channel_pre_norm.weight", "same"),
    ("mlp_block/ffw_up/w", "mlp_block.gate_proj.weight mlp_block.up_proj.weight",
     "branch_linear"),
    ("mlp_block/ffw_up/b", "mlp_block.gate_proj.bias mlp_block.up_proj.bias", "branch_bias"),
    ("mlp_block/ffw_down/kernel", "mlp_block.down_proj.weight", "linear"),
    ("mlp_block/ffw_down/bias", "mlp_block.down_proj.bias", "same"),
)
_TEMPORAL_TENSORS = {
    "recurrent": (
        ("recurrent_block/linear_x/kernel", "temporal_block.linear_x.weight", "linear"),
        ("recurrent_block/linear_x/bias", "temporal_block.linear_x.bias", "same"),
        ("recurrent_block/linear_y/kernel", "temporal_block.linear_y.weight", "linear"),
        ("recurrent_block/linear_y/bias", "temporal_block.linear_y.bias", "same"),
        ("recurrent_block/linear_out/kernel", "temporal_block.linear_out.weight", "linear"),
        ("recurrent_block/linear_out/bias", "temporal_block.linear_out.bias", "same"),
        ("recurrent_block/conv_1d/w", "temporal_block.conv_1d.weight", "conv"),
        ("recurrent_block/conv_1d/b", "temporal_block.conv_1d.bias", "same"),
        ("recurrent_block/rg_lru/a_param", "temporal_block.rg_lru.recurrent_param", "same"),
        ("recurrent_block/rg_lru/input_gate/w", "temporal_block.rg_lru.input_gate_weight",
         "same"),
        ("recurrent_block/rg_lru/input_gate/b", "temporal_block.rg_lru.input_gate_bias", "same"),
        ("recurrent_block/rg_lru/a_gate/w", "temporal_block.rg_lru.recurrent_gate_weight",
         "same"),
        ("recurrent_block/rg_lru/a_gate/b", "temporal_block.rg_lru.recurrent_gate_bias", "same"),
    ),
    "attention": (
        ("attention_block/proj_q/kernel", "temporal_block.q_proj.weight", "linear"),
        ("attention_block/proj_k/kernel", "temporal_block.k_proj.weight", "linear"),
        ("attention_block/proj_v/kernel", "temporal_block.v_proj.weight", "linear"),
        ("attention_block/proj_final/kernel", "temporal_block.o_proj.weight", "linear"),
        ("attention_block/proj_final/bias", "temporal_block.o_proj.bias", "same"),
    ),
}
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """One of our parameters (``path`` in the per-layer tree) and its transformers tensors."""

  path: tuple
  names: tuple[str, ...]
  layout: str

  def to_hf(self, value) -> tuple:
    return _LAYOUTS[self.layout][0](value)

  def from_hf(self, *tensors):
    return _LAYOUTS[self.layout][1](*tensors)


def tensor_table(cfg: model_lib.ModelConfig) -> list[TensorMap]:
  """Every parameter of ``cfg``'s per-layer tree with its transformers names, in the order
  the tensors are written (embedding, layers, final norm)."""
  table = [TensorMap(("embedder", "input_embedding"), (EMBEDDING,), "same")]
  for i, block_type in enumerate(cfg.resolved_block_types):
    if block_type not in _TEMPORAL_TENSORS:
      raise CheckpointError(f"block {i} is {block_type!r}, which transformers' RecurrentGemma "
                            "does not have")
    for ours, names, layout in _BLOCK_TENSORS + _TEMPORAL_TENSORS[block_type]:
      table.append(TensorMap(("blocks", i, *ours.split("/")),
                             tuple(f"model.layers.{i}.{n}" for n in names.split()), layout))
  table.append(TensorMap(("final_norm", "scale"), ("model.final_norm.weight",), "same"))
  return table


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def is_hf_dir(path: str) -> bool:
  """Whether ``path`` looks like a transformers model directory (it has a ``config.json``)."""
  return os.path.isfile(os.path.join(path, CONFIG))


def read_hf_config(path: str) -> dict[str, Any]:
  try:
    with open(os.path.join(path, CONFIG)) as f:
      hf = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path!r}: cannot read {CONFIG}: {first_line(e)}") from None
  if not isinstance(hf, dict):
    raise CheckpointError(f"{path!r}: {CONFIG} is not a JSON object")
  return hf


def config_from_hf(hf: dict[str, Any], *, param_dtype: str = "float32",
                   source: str = CONFIG) -> model_lib.ModelConfig:
  """Our ``ModelConfig`` of transformers' ``RecurrentGemmaConfig`` fields (a ``config.json``
  as a dict); a ``CheckpointError`` naming the field when ours cannot express it."""

  def field(name, default=None):
    value = hf.get(name)
    return default if value is None else value

  def refuse(why):
    raise CheckpointError(f"{source}: {why}")

  if field("model_type", "recurrent_gemma") != "recurrent_gemma":
    refuse(f"model_type is {hf['model_type']!r}, not 'recurrent_gemma'")
  try:
    width, heads = int(field("hidden_size", 2560)), int(field("num_attention_heads", 10))
    num_layers = int(field("num_hidden_layers", 26))
    intermediate = int(field("intermediate_size", 3 * 2560))
    pattern = [str(t) for t in field("block_types", ["recurrent", "recurrent", "attention"])]
    window = int(field("attention_window_size", 2048))
    kv_heads = int(field("num_key_value_heads", heads))
    rope = dict(field("rope_parameters", {}))
    theta = float(rope.get("rope_theta", field("rope_theta", ROPE_THETA)))
    factor = float(rope.get("partial_rotary_factor",
                            field("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)))
    cap, eps = float(field("logits_soft_cap", 30.0)), float(field("rms_norm_eps", RMS_NORM_EPS))
    lru_width = int(field("lru_width", width))
    vocab_size, conv_width = int(field("vocab_size", 256000)), int(field("conv1d_width", 4))
  except (TypeError, ValueError) as e:
    refuse(f"a field has the wrong type: {first_line(e)}")
  if not pattern or any(t not in _TEMPORAL_TENSORS for t in pattern):
    refuse(f"block_types={pattern} must list 'recurrent' and 'attention' blocks")
  block_types = tuple((pattern * (num_layers // len(pattern) + 1))[:num_layers])
  has_attention = "attention" in block_types
  activation = field("hidden_activation", field("hidden_act", ACTIVATION))
  if activation != ACTIVATION:
    refuse(f"hidden_activation={activation!r}: ours is the tanh GeLU ({ACTIVATION!r})")
  if intermediate <= 0 or intermediate % 2:
    refuse(f"intermediate_size={intermediate} must be even (both MLP branches together)")
  if not math.isclose(eps, RMS_NORM_EPS):
    refuse(f"rms_norm_eps={eps}: ours is {RMS_NORM_EPS}")
  if cap <= 0:
    refuse(f"logits_soft_cap={cap} must be > 0")
  if field("attention_bias", False):
    refuse("attention_bias=true: our query, key and value projections have no bias")
  if not field("tie_word_embeddings", True):
    refuse("tie_word_embeddings=false: our output layer is the input embedding")
  if has_attention:
    if kv_heads != 1:
      refuse(f"num_key_value_heads={kv_heads}: ours has one key/value head (multi-query)")
    if window < 2:
      refuse(f"attention_window_size={window} lets a token see only itself; our smallest "
             "window sees 2 keys")
    if rope.get("rope_type", "default") != "default" or not math.isclose(theta, ROPE_THETA):
      refuse(f"rope_parameters={rope}: ours is the default RoPE with rope_theta={ROPE_THETA}")
    if not math.isclose(factor, PARTIAL_ROTARY_FACTOR):
      refuse(f"partial_rotary_factor={factor}: ours rotates half of each head")
  cfg = model_lib.ModelConfig(
      family="griffin" if has_attention else "hawk", vocab_size=vocab_size, width=width,
      num_layers=num_layers, num_heads=heads, lru_width=lru_width,
      mlp_expanded_width=intermediate // 2, num_gate_blocks=heads,
      attention_window_size=max(window - 1, 1), conv1d_temporal_width=conv_width,
      embeddings_scale_by_sqrt_dim=True, logits_soft_cap=cap, block_types=block_types,
      param_dtype=param_dtype, scan_layers=False)
  errors = cfg.errors()
  if errors:
    refuse(f"the architecture is not valid here: {errors[0]}")
  return cfg


def export_problems(cfg: model_lib.ModelConfig) -> list[str]:
  """Everything in ``cfg`` that transformers' RecurrentGemma cannot express (empty: it can
  all be): the griffin or hawk family with local attention only, one RG-LRU gate block per
  head where there is attention, the embedding scaled by sqrt(width) and the logits capped
  (RecurrentGemma's settings: configs/recurrentgemma.py, imported checkpoints)."""
  problems = []
  family = cfg.family in ("griffin", "hawk")
  if not family:
    problems.append(f"model.family={cfg.family!r}: transformers' RecurrentGemma has only the "
                    "griffin and hawk families")
  # (The blocks and gates of the other families follow from the family.)
  for block_type in dict.fromkeys(cfg.resolved_block_types) if family else ():
    if block_type == "global_attention":
      problems.append("a global attention block (no window): transformers' RecurrentGemma has "
                      "only local attention")
    elif block_type not in _TEMPORAL_TENSORS:
      problems.append(f"a {block_type!r} block: transformers' RecurrentGemma has none")
  if family and cfg.has_attention and cfg.resolved_gate_blocks != cfg.num_heads:
    problems.append(f"model.num_gate_blocks={cfg.resolved_gate_blocks} with model.num_heads="
                    f"{cfg.num_heads}: transformers uses one RG-LRU gate block per head")
  if not cfg.embeddings_scale_by_sqrt_dim:
    problems.append("model.embeddings_scale_by_sqrt_dim=false: transformers always scales the "
                    "embedding")
  if cfg.logits_soft_cap <= 0:
    problems.append("model.logits_soft_cap=0: transformers always caps the logits")
  return problems


def export_problem(cfg: model_lib.ModelConfig) -> str | None:
  """:func:`export_problems` as one line (None: there is none)."""
  problems = export_problems(cfg)
  return "; ".join(problems) if problems else None


def hf_config(cfg: model_lib.ModelConfig, *, dtype: str,
              special_ids: dict[str, int] | None = None) -> dict[str, Any]:
  """The ``config.json`` of ``cfg`` for ``RecurrentGemmaForCausalLM`` (``export_problem``
  must be None)."""
  types = list(cfg.resolved_block_types)
  pattern = list(cfg.layer_pattern)
  if (pattern * 100)[:len(types)] != types:  # transformers repeats block_types 100 times
    pattern = types
  has_attention = cfg.has_attention
  return {
      "architectures": ["RecurrentGemmaForCausalLM"],
      "model_type": "recurrent_gemma",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.width,
      "intermediate_size": 2 * cfg.resolved_mlp_width,
      # (Without attention the heads only count the gate blocks.)
      "num_attention_heads": cfg.num_heads if has_attention else cfg.resolved_gate_blocks,
      "num_key_value_heads": 1,
      "num_hidden_layers": cfg.num_layers,
      "lru_width": cfg.resolved_lru_width,
      "block_types": pattern,
      "attention_window_size": cfg.attention_window_size + 1,
      "conv1d_width": cfg.conv1d_temporal_width,
      "logits_soft_cap": float(cfg.logits_soft_cap),
      "rms_norm_eps": RMS_NORM_EPS,
      "hidden_activation": ACTIVATION,
      "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA,
                          "partial_rotary_factor": PARTIAL_ROTARY_FACTOR},
      "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
      "attention_bias": False,
      "tie_word_embeddings": True,
      "dtype": dtype,
      # transformers before 4.56 reads only torch_dtype (from_pretrained's torch_dtype="auto");
      # later ones read dtype and take torch_dtype, without a warning, where dtype is absent
      "torch_dtype": dtype,
      **(special_ids or {}),
  }


# ---------------------------------------------------------------------------------------------
# safetensors files


class SafetensorsReader:
  """The tensors of a transformers directory (one file or shards with an index), read one at
  a time through safetensors' NumPy API; a context manager."""

  def __init__(self, path: str):
    self.path = path
    index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
        self.files = {str(k): os.path.join(path, str(v)) for k, v in weight_map.items()}
      except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path!r}: cannot read {INDEX}: {first_line(e)}") from None
    elif os.path.isfile(single):
      self.files = None
    else:
      raise CheckpointError(f"{path!r} has {CONFIG} but neither {SINGLE_FILE} nor {INDEX}")
    self._open: dict[str, Any] = {}
    if self.files is None:
      self.files = {name: single for name in self._handle(single).keys()}
    missing = sorted({f for f in self.files.values() if not os.path.isfile(f)})
    if missing:
      raise CheckpointError(f"{path!r}: {INDEX} names {os.path.basename(missing[0])!r}, which "
                            "does not exist")

  def _handle(self, file: str):
    if file not in self._open:
      try:
        self._open[file] = safe_open(file, framework="np").__enter__()
      except Exception as e:  # safetensors raises its own error types for damaged files.
        raise CheckpointError(f"{file!r} is not a readable safetensors file: "
                              f"{first_line(e)}") from None
    return self._open[file]

  def names(self) -> list[str]:
    return list(self.files)

  def dtype(self, name: str) -> str:
    """The safetensors dtype code (``F32``, ``BF16``, ...)."""
    return self._handle(self.files[name]).get_slice(name).get_dtype()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    try:
      return self._handle(self.files[name]).get_tensor(name)
    except Exception as e:  # a shard that does not hold what the index says, a bad dtype
      raise CheckpointError(f"{self.files[name]!r}: cannot read {name!r}: "
                            f"{first_line(e)}") from None

  def close(self) -> None:
    for handle in self._open.values():
      handle.__exit__(None, None, None)
    self._open.clear()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _shard_names(count: int) -> list[str]:
  if count == 1:
    return [SINGLE_FILE]
  return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_safetensors(dst: str, tensors: list[tuple[str, Any]], dtype,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
  """Writes ``(name, array)`` pairs, each cast to ``dtype``, into ``dst`` as transformers'
  ``save_pretrained`` lays them out: ``model.safetensors``, or shards of at most
  ``max_shard_bytes`` each (a larger tensor alone in its shard) with ``model.safetensors.
  index.json``. Returns the files written.

  The safetensors format (an 8-byte little-endian header length, a JSON header of names,
  dtypes, shapes and byte ranges, then the bytes) is written here rather than with
  ``safetensors.numpy.save_file``, which needs every tensor of a shard in memory at once:
  here one tensor is converted and copied at a time.
  """
  dtype = np.dtype(dtype)
  shards: list[list[tuple[str, Any]]] = [[]]
  size = 0
  for name, array in tensors:
    nbytes = math.prod(np.shape(array)) * dtype.itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, array))
    size += nbytes
  files = _shard_names(len(shards))
  for file, shard in zip(files, shards):
    _write_file(os.path.join(dst, file), shard, dtype)
  if len(files) > 1:
    total = sum(math.prod(np.shape(a)) for _, a in tensors) * dtype.itemsize
    index = {"metadata": {"total_size": total},
             "weight_map": {name: file for file, shard in zip(files, shards)
                            for name, _ in shard}}
    with open(os.path.join(dst, INDEX), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
    files.append(INDEX)
  return files


def _write_file(path: str, tensors: list[tuple[str, Any]], dtype: np.dtype) -> None:
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, array in tensors:
    nbytes = math.prod(np.shape(array)) * dtype.itemsize
    header[name] = {"dtype": _CODES[dtype], "shape": list(np.shape(array)),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # (the data starts 8-byte aligned, as safetensors writes it)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for _, array in tensors:
      data = np.ascontiguousarray(np.asarray(array), dtype=dtype)
      f.write(data.reshape(-1).view(np.uint8).data)  # (bytes: buffers reject bfloat16)


# ---------------------------------------------------------------------------------------------
# Whole checkpoints


def _per_layer_shapes(cfg: model_lib.ModelConfig) -> dict:
  per_layer = dataclasses.replace(cfg, scan_layers=False)
  return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: model_lib.init_model(per_layer))))


def _param_dtype(reader: SafetensorsReader) -> str:
  """bfloat16 when every tensor is, else float32 (which holds bfloat16 and float16 exactly)."""
  codes = {reader.dtype(name) for name in reader.names()}
  bad = sorted(codes - {"F32", "BF16", "F16"})
  if bad:
    raise CheckpointError(f"{reader.path!r} has {bad[0]} tensors; expected float32, bfloat16 "
                          "or float16")
  return "bfloat16" if codes == {"BF16"} else "float32"


def read_params(reader: SafetensorsReader, cfg: model_lib.ModelConfig) -> dict:
  """Our per-layer parameter tree (``blocks[i]``, as the official importer writes) from the
  tensors of ``reader``, in ``cfg.param_dtype``, one tensor read at a time."""
  dtype = np.dtype(model_lib.DTYPES[cfg.param_dtype])
  # Stored name by full name (a bare RecurrentGemmaModel's names lack the "model." prefix).
  names = {(n if n.startswith(("model.", "lm_head.")) else "model." + n): n
           for n in reader.names()}
  shapes = _per_layer_shapes(cfg)
  tree: dict = {}
  used = set()
  for entry in tensor_table(cfg):
    expected = _get(shapes, entry.path).shape
    # Views of a zero-strided array: the transformers shapes, nothing allocated.
    wanted = [t.shape for t in entry.to_hf(np.broadcast_to(np.zeros((), dtype), expected))]
    arrays = []
    for name, shape in zip(entry.names, wanted):
      if name not in names:
        raise CheckpointError(f"{reader.path!r} has no tensor {name!r}")
      if reader.shape(names[name]) != shape:
        raise CheckpointError(f"{reader.path!r}: {name!r} has shape "
                              f"{list(reader.shape(names[name]))}; config.json implies "
                              f"{list(shape)}")
      arrays.append(reader.get(names[name]))
      used.add(name)
    value = np.ascontiguousarray(entry.from_hf(*arrays), dtype=dtype)
    del arrays
    _set(tree, entry.path, jax.numpy.asarray(value))
  if LM_HEAD in names:
    used.add(LM_HEAD)
    head, embedding = reader.get(names[LM_HEAD]), reader.get(names[EMBEDDING])
    if head.shape != embedding.shape or head.tobytes() != embedding.tobytes():
      raise CheckpointError(f"{reader.path!r}: {LM_HEAD!r} differs from {EMBEDDING!r}; our "
                            "output layer is the input embedding")
  unused = sorted(set(names) - used)
  if unused:
    raise CheckpointError(f"{reader.path!r} has a tensor {unused[0]!r} that config.json's "
                          "architecture has no place for")
  return tree


# Set in an exported config.json when the model was trained on bytes (data.tokenizers.
# ByteTokenizer), which ship no tokenizer file: the import records "byte" again.
BYTE_TOKENIZER_KEY = "recurrentgemma_jax_tokenizer"
_BYTE_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # ByteTokenizer's
_BYTE_VOCAB = 259


def _is_byte_model(hf: dict[str, Any]) -> bool:
  """Whether ``config.json`` is of a byte-level model we exported: marked, or (exported
  before the mark) the byte tokenizer's vocabulary and special ids."""
  if hf.get(BYTE_TOKENIZER_KEY) == "byte":
    return True
  return hf.get("vocab_size") == _BYTE_VOCAB and all(
      hf.get(k) == v for k, v in _BYTE_IDS.items())


def import_checkpoint(src: str, dst: str, *, tokenizer: str | None = None
                      ) -> model_lib.ModelConfig:
  """A transformers RecurrentGemma directory -> our checkpoint at ``dst`` (per-layer layout,
  parameters in bfloat16 when every tensor is, else float32). ``tokenizer`` (a SentencePiece
  file, copied into ``dst``: ``checkpoint.save_model``), else a ``tokenizer.model`` beside the
  weights, else "byte" for a byte-level model we exported, is recorded with it."""
  hf = read_hf_config(src)
  with SafetensorsReader(src) as reader:
    cfg = config_from_hf(hf, param_dtype=_param_dtype(reader),
                         source=os.path.join(src, CONFIG))
    params = read_params(reader, cfg)
  if tokenizer is None and os.path.isfile(os.path.join(src, TOKENIZER)):
    tokenizer = os.path.join(src, TOKENIZER)
  elif tokenizer is None and _is_byte_model(hf):
    tokenizer = "byte"
  checkpoint.save_model(dst, params, cfg, tokenizer=tokenizer)
  return cfg


def read_checkpoint_params(path: str) -> tuple[model_lib.ModelConfig, dict, dict]:
  """``(config, per-layer parameter tree of NumPy arrays, raw model_config JSON)`` of one of
  our checkpoints or training workdirs (its newest readable step; a layer-stacked tree is
  sliced, not copied)."""
  dirs, cfg, meta = checkpoint.newest_readable_config(path)
  problem = export_problem(cfg)
  if problem:
    raise CheckpointError(f"checkpoint {dirs[0]!r} cannot be exported to transformers: "
                          f"{problem}")
  cfg = checkpoint.portable(cfg)  # (any machine builds the model: no kernel of another's)
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.init_model(cfg)))
  params, _ = checkpoint.restore_newest(dirs, abstract, cfg=cfg)
  tree = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
  if cfg.layers_scanned:
    tree = model_lib.unstack_layers(tree, cfg)
  return cfg, tree, meta


def hf_tensors(cfg: model_lib.ModelConfig, tree: dict) -> list[tuple[str, np.ndarray]]:
  """``(transformers name, array)`` for every tensor of a per-layer tree (views where the
  layout allows); every parameter of the tree must have a place."""
  out, used = [], 0
  for entry in tensor_table(cfg):
    out.extend(zip(entry.names, entry.to_hf(_get(tree, entry.path))))
    used += 1
  if used != len(jax.tree.leaves(tree)):
    raise CheckpointError(f"the parameter tree has {len(jax.tree.leaves(tree))} arrays; "
                          f"transformers' layout places {used}")
  return out


def _special_ids(tokenizer: str | None) -> dict[str, int]:
  if tokenizer == "byte":
    return dict(_BYTE_IDS)
  if tokenizer and os.path.isfile(tokenizer):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    sp = sentencepiece.SentencePieceProcessor()
    with open(tokenizer, "rb") as f:
      sp.LoadFromSerializedProto(f.read())
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.unk_id()
    return {"pad_token_id": pad, "bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id()}
  return {}


def export_checkpoint(path: str, dst: str, *, dtype: str | None = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES,
                      warn: Callable[[str], None] = checkpoint.warn
                      ) -> tuple[model_lib.ModelConfig, list[str]]:
  """One of our griffin or hawk checkpoints (or a training workdir's latest) -> a directory
  that ``RecurrentGemmaForCausalLM.from_pretrained`` loads: ``config.json``, safetensors
  (``dtype``: the checkpoint's parameter dtype unless given) and the SentencePiece tokenizer
  recorded with the checkpoint, if any (a byte-level model: its special ids and
  ``BYTE_TOKENIZER_KEY``). A tokenizer that cannot be found is left out with a ``warn``
  line. Returns the config and the files written."""
  cfg, tree, meta = read_checkpoint_params(path)
  dtype = dtype or (cfg.param_dtype if cfg.param_dtype in ("float32", "bfloat16") else "float32")
  tensors = hf_tensors(cfg, tree)
  tokenizer = meta.get("tokenizer")
  left_out = ("the export has no tokenizer.model and config.json no pad, bos and eos ids")
  if not tokenizer:
    warn(f"warning: checkpoint {path!r} records no tokenizer; {left_out}")
  elif tokenizer != "byte" and not os.path.isfile(tokenizer):
    warn(f"warning: the tokenizer {tokenizer!r} recorded with checkpoint {path!r} does not "
         f"exist (from {os.getcwd()!r}); {left_out}")
    tokenizer = None
  config = hf_config(cfg, dtype=dtype, special_ids=_special_ids(tokenizer))
  if tokenizer == "byte":
    config[BYTE_TOKENIZER_KEY] = "byte"
  os.makedirs(dst)
  try:
    files = write_safetensors(dst, tensors, model_lib.DTYPES[dtype], max_shard_bytes)
    with open(os.path.join(dst, CONFIG), "w") as f:
      json.dump(config, f, indent=2)
    files.append(CONFIG)
    if tokenizer and tokenizer != "byte":
      shutil.copyfile(tokenizer, os.path.join(dst, TOKENIZER))
      files.append(TOKENIZER)
  except BaseException:
    shutil.rmtree(dst, ignore_errors=True)  # no half-written export
    raise
  return cfg, files
