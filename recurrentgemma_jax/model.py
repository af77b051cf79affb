"""The language model: embedder, residual blocks from a per-layer pattern, final norm, tied
output layer (``model.family`` picks the pattern: griffin, hawk, mqa or gla).

A residual block is ``x + temporal(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))``; the temporal
block is the recurrent block (RG-LRU), MQA attention (local or global) or GLA.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels import dispatch
from pallas_kernels import loss as loss_kernels
from pallas_kernels import mlp as mlp_kernels
from pallas_kernels.mlp import gated_up
from pallas_kernels.sampling import greedy
from recurrentgemma_jax import attention
from recurrentgemma_jax import layers
from recurrentgemma_jax import recurrent
from sharding import partitioning

FAMILIES = ("griffin", "hawk", "mqa", "gla")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
# gate_impl, mlp_impl, conv1d_impl, norm_impl, decode_impl: a Pallas kernel or XLA (auto:
# _kernel_on_gpus)
KERNEL_IMPLS = ("auto", "xla", "pallas")
FUSED_RG_LRU = ("auto", "true", "false")
SCAN_LAYERS = ("auto", "true", "false")
BLOCK_TYPES = ("recurrent", "attention", "global_attention", "gla")
REMAT_POLICIES = ("none", "block", "dots")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}

# The repeated unit of each family's block pattern.
FAMILY_PATTERNS = {
    "griffin": ("recurrent", "recurrent", "attention"),
    "hawk": ("recurrent",),
    "mqa": ("global_attention",),
    "gla": ("gla",),
}
# The block types a model of each family may list in ``block_types``. Griffin, the mixed
# family, takes any mix (the synthetic tasks' Hawk and MQA baselines, hybrids with GLA blocks).
FAMILY_BLOCKS = {
    "griffin": BLOCK_TYPES,
    "hawk": ("recurrent",),
    "mqa": ("attention", "global_attention"),
    "gla": ("gla",),
}


def cudnn_attention_problem(dtype: str, head_dim: int) -> str | None:
  """Why ``jax.nn.dot_product_attention(implementation="cudnn")`` cannot run this model here
  (None: it can). The one statement of these limits: ``auto`` and the config check use it.
  The platform is the one compiled for (``dispatch.target_platform``)."""
  backend = dispatch.target_platform()
  if backend != "gpu":
    return f"needs NVIDIA GPUs; this run's devices are {backend}"
  if dtype not in ("bfloat16", "float16") or head_dim > 128 or head_dim % 8:
    return (f"needs model.dtype bfloat16 or float16 (got {dtype!r}) and a head size of at most "
            f"128 that is a multiple of 8 (got {head_dim})")
  capability = dispatch.gpu_capability()
  if capability is not None and capability >= 8.0:
    return None
  return f"needs a GPU of compute capability 8.0 or more (got {capability})"


def splash_attention_problem(dtype: str) -> str | None:
  """Why TPU splash attention (``pallas_kernels.attention.splash_mqa``) cannot run this model
  on the platform being compiled for (None: it can; a CPU runs it in the Pallas interpreter).
  ``auto`` and the config check use it; the limits are stated once, in
  ``pallas_kernels.attention.problem``."""
  from pallas_kernels import attention as attention_kernels  # pylint: disable=g-import-not-at-top
  return attention_kernels.problem(dtype, dispatch.target_platform())


def _kernel_on_gpus(choice: str) -> str:
  """An ``auto | xla | pallas`` choice resolved: ``auto`` is the Pallas kernel when compiling
  for GPUs, XLA elsewhere."""
  if choice != "auto":
    return choice
  return "pallas" if dispatch.target_platform() == "gpu" else "xla"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a model (the ``model`` part of a run config).

  ``block_types`` is derived from ``family`` and ``num_layers`` unless given explicitly (the
  importer reads it off a checkpoint).
  """

  family: str = "griffin"
  vocab_size: int = 256_000
  width: int = 2560
  num_layers: int = 26
  num_heads: int = 10
  lru_width: int | None = None          # None: equal to width
  mlp_expanded_width: int | None = None  # None: 3 * width
  attention_window_size: int = 2048
  num_gate_blocks: int | None = None     # block-diagonal RG-LRU gate blocks; None: num_heads
  conv1d_temporal_width: int = 4
  # The RG-LRU's initial decay: a^c uniform in [rg_lru_min_ac, rg_lru_max_ac] (the paper's 0.9,
  # 0.999). Initialisation only: checkpoints do not depend on it.
  rg_lru_min_ac: float = 0.9
  rg_lru_max_ac: float = 0.999
  embeddings_scale_by_sqrt_dim: bool = True
  logits_soft_cap: float = 30.0          # 0 disables the tanh cap
  block_types: tuple[str, ...] | None = None
  # GLA (Yang et al. 2023): heads, key/value expansion and the rank of the forget gate.
  gla_num_heads: int | None = None       # None: num_heads
  gla_expand_k: float = 0.5
  gla_expand_v: float = 1.0
  gla_gate_rank: int = 16
  gla_chunk_size: int = 64
  # Numerics and kernels.
  param_dtype: str = "float32"
  dtype: str = "bfloat16"
  scan_impl: str = "auto"
  attention_impl: str = "auto"          # auto | xla | cudnn (NVIDIA GPUs) | splash (TPUs)
  fused_rg_lru: str = "auto"            # auto | true | false: the RG-LRU layer as one fused kernel
  gate_impl: str = "auto"               # auto | xla | pallas: the RG-LRU's block-diagonal gate matmuls
  mlp_impl: str = "auto"                # auto | xla | pallas: the MLP's GeLU gating (its backward;
                                        # in a decoding step, with the up-projection)
  conv1d_impl: str = "auto"             # auto | xla | pallas: the recurrent block's Conv1D backward
  norm_impl: str = "auto"               # auto | xla | pallas: the blocks' RMSNorm backward
  decode_impl: str = "auto"             # auto | xla | pallas: the decoding step's kernels (a
                                        # recurrent block's gates and update; the greedy token)
  loss_impl: str = "auto"               # auto | xla | pallas: the training loss's cross-entropy
  remat: str = "none"
  scan_layers: str = "auto"  # auto | true | false: layers as one lax.scan (auto: with remat)

  @property
  def resolved_block_types(self) -> tuple[str, ...]:
    if self.block_types is not None:
      return tuple(self.block_types)
    return tuple(itertools.islice(itertools.cycle(FAMILY_PATTERNS[self.family]),
                                  self.num_layers))

  @property
  def layer_pattern(self) -> tuple[str, ...]:
    """The shortest run of block types that ``resolved_block_types`` repeats (the family's
    pattern when the types are derived: 26 griffin layers are 8 x (recurrent, recurrent,
    attention), then recurrent, recurrent). With ``scan_layers`` each position of it is one
    stack of ``scan_repeats`` layers; the remaining layers run unrolled after the scan."""
    types = self.resolved_block_types
    period = next((p for p in range(1, len(types) + 1)
                   if all(types[i] == types[i - p] for i in range(p, len(types)))), len(types))
    return types[:period]

  @property
  def scan_repeats(self) -> int:
    """How many times ``layer_pattern`` runs whole: the length of the layer scan."""
    return len(self.resolved_block_types) // len(self.layer_pattern)

  @property
  def has_attention(self) -> bool:
    """Whether any block is (local or global) attention: only then do the attention settings
    (heads dividing the width, ``attention_impl``) matter."""
    return any(t in ("attention", "global_attention") for t in self.resolved_block_types)

  @property
  def resolved_lru_width(self) -> int:
    return self.lru_width or self.width

  @property
  def resolved_mlp_width(self) -> int:
    return self.mlp_expanded_width or 3 * self.width

  @property
  def resolved_gate_blocks(self) -> int:
    return self.num_gate_blocks or self.num_heads

  @property
  def head_dim(self) -> int:
    return self.width // self.num_heads

  @property
  def resolved_attention_impl(self) -> str:
    """``auto``: TPU splash attention when compiling for TPUs (float32 or bfloat16; the
    platform is ``dispatch.target_platform()`` where the model is built: under the TPU mesh for
    a compile-only TPU program), cuDNN flash attention where it runs (NVIDIA GPUs of compute
    capability 8.0 or more, bfloat16 or float16, head size <= 128 and a multiple of 8: 2.1x
    faster training steps for the MQA baseline on an H100, docs/performance.md), else XLA."""
    if self.attention_impl != "auto":
      return self.attention_impl
    if dispatch.target_platform() == "tpu" and not splash_attention_problem(self.dtype):
      return "splash"
    return "xla" if cudnn_attention_problem(self.dtype, self.head_dim) else "cudnn"

  @property
  def resolved_gate_impl(self) -> str:
    """``auto``: the Triton gate kernels on GPUs (1.6% faster Griffin-400M training steps on an
    H100 than XLA's batched matmul, docs/performance.md), else XLA. Gate blocks that are not a
    multiple of 16 take the XLA path either way."""
    return _kernel_on_gpus(self.gate_impl)

  @property
  def resolved_mlp_impl(self) -> str:
    """``auto``: the Triton kernels of ``pallas_kernels.mlp`` on GPUs, else XLA. In training,
    the gating's backward (MQA-400M steps 2.5% faster on an H100 than XLA's autodiff of the
    gating, docs/performance.md); in a decoding step, the up-projection with its GeLU gating as
    one kernel (``gated_up``) that writes only the gated product, where XLA writes both branches
    and reads them again, from ``gated_up.MIN_ROWS`` (1024) rows a device (on an H100 at 2048
    rows: Hawk 1.3B's decoding step 0.23 ms faster, 14.79 against 15.02 ms, Griffin's 0.23 ms,
    MQA's at 1024 rows 0.24 ms; slower at 512 rows and fewer; docs/bench/decode_log.md,
    session 29)."""
    return _kernel_on_gpus(self.mlp_impl)

  @property
  def resolved_conv1d_impl(self) -> str:
    """``auto``: the Triton backward of ``pallas_kernels.conv1d`` on GPUs (on an H100: 82-84%
    of its bytes floor against XLA's 69-70%, Griffin-400M steps 0.3-1.3 ms and 1.3B steps
    3.6 ms faster, gradients in float32 instead of bfloat16; docs/performance.md), else XLA."""
    return _kernel_on_gpus(self.conv1d_impl)

  @property
  def resolved_norm_impl(self) -> str:
    """``auto``: the Triton backward of ``pallas_kernels.norm`` on GPUs, which adds the skip's
    gradient in the same pass (docs/bench/performance_log.md, session 18), else XLA."""
    return _kernel_on_gpus(self.norm_impl)

  @property
  def resolved_decode_impl(self) -> str:
    """``pallas``: a recurrent block's one-token step after its Conv1D (both gates and the
    RG-LRU update) as one Triton kernel, ``pallas_kernels.rg_lru.decode`` (interpreted on a
    CPU; a TPU takes XLA's), where XLA runs the gate kernel and then passes of its own, from
    ``decode.MIN_ROWS`` (16) rows a device. ``auto``: on GPUs (on an H100 at Hawk 1.3B's
    2048 rows: the decoding step 14.17-14.19 ms against 14.55-14.59 with the kernel's earlier
    tiles (session 32) and 14.67 with XLA's step (session 30); Griffin's 17.20-17.25 against
    17.42-17.44 with the earlier tiles; docs/bench/decode_log.md). Also greedy decoding's
    output layer and argmax as one kernel that never writes the logits
    (``Model.greedy_extend``, ``pallas_kernels.sampling.greedy``), from ``greedy.MIN_ROWS``
    (128) rows a device."""
    return _kernel_on_gpus(self.decode_impl)

  @property
  def resolved_loss_impl(self) -> str:
    """``pallas``: the training loss's cross-entropy through ``pallas_kernels.loss``, whose
    log-sum-exp reads the logits once where XLA's reads them twice, and the model hands it the
    logits in the compute dtype (``Model.__call__(upcast_logits=False)``). ``auto``: on GPUs,
    for models without a logit soft cap (a capped model's loss already takes one pass,
    ``train.masked_cross_entropy``) and vocabularies of ``loss.MIN_VOCAB`` (4096) or more."""
    if self.loss_impl != "auto":
      return self.loss_impl
    if (self.logits_soft_cap or self.vocab_size < loss_kernels.MIN_VOCAB
        or not loss_kernels.supported(self.vocab_size)):
      return "xla"
    return _kernel_on_gpus("auto")

  @property
  def layers_scanned(self) -> bool:
    """Whether the layers run as one ``lax.scan`` over stacked parameters (``Model``), which
    keeps the compile time flat in depth. ``auto``: with rematerialisation (``remat`` block or
    dots), where each block is recomputed anyway; unrolled without. Measured on an H100
    (Griffin-400M, T=2048, 16 rows; docs/tpu.md): remat block, scanned 230 ms and 14.1 GiB
    against 233 ms and 11.9 GiB unrolled (GLA-340M 271 against 285 ms); no remat, scanned
    276 ms and 69.8 GiB against 191 ms and 38.0 GiB, and Hawk and GLA did not fit scanned."""
    if isinstance(self.scan_layers, bool):
      return self.scan_layers
    if self.scan_layers == "auto":
      return self.remat != "none"
    return self.scan_layers == "true"

  @property
  def resolved_fused_rg_lru(self) -> bool:
    """``auto``: the fused RG-LRU kernel on GPUs (with it Griffin-400M's training step went from
    1.06 to 1.03x MQA's at T=2048 on an H100, docs/performance.md), the XLA gating and the scan
    kernel elsewhere. Checkpoints written before this option was a string hold a bool."""
    if isinstance(self.fused_rg_lru, bool):
      return self.fused_rg_lru
    if self.fused_rg_lru == "auto":
      return dispatch.target_platform() == "gpu"
    return self.fused_rg_lru == "true"

  @classmethod
  def from_dict(cls, d: Any) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in dict(d).items() if k in fields}
    if kwargs.get("block_types") is not None:
      kwargs["block_types"] = tuple(kwargs["block_types"])
    return cls(**kwargs)

  def errors(self) -> list[str]:
    """One line per invalid field (empty when the architecture can be built)."""
    out = []
    if self.family not in FAMILIES:
      out.append(f"model.family={self.family!r} is not one of {'|'.join(FAMILIES)}")
      return out
    for name in ("vocab_size", "width", "num_layers", "num_heads", "attention_window_size",
                 "conv1d_temporal_width"):
      if int(getattr(self, name)) <= 0:
        out.append(f"model.{name}={getattr(self, name)} must be a positive integer")
    if out:
      return out
    types = self.resolved_block_types
    bad = [t for t in types if t not in BLOCK_TYPES]
    if bad:
      out.append(f"model.block_types has {bad[0]!r}; allowed: {'|'.join(BLOCK_TYPES)}")
    elif self.block_types is not None:
      # The family names the model (logs, checkpoints, export); its blocks must agree.
      foreign = [t for t in types if t not in FAMILY_BLOCKS[self.family]]
      if foreign:
        out.append(f"model.block_types has {foreign[0]!r}, which a {self.family} model does not "
                   f"have ({'|'.join(FAMILY_BLOCKS[self.family])}); set model.family to match, "
                   "or model.block_types='' to take the blocks from model.family")
    sizes = {"mlp_expanded_width": self.resolved_mlp_width}
    if "recurrent" in types:
      sizes.update(lru_width=self.resolved_lru_width, num_gate_blocks=self.resolved_gate_blocks)
    if "gla" in types:
      sizes.update(gla_num_heads=self.gla_num_heads or self.num_heads,
                   gla_gate_rank=self.gla_gate_rank, gla_chunk_size=self.gla_chunk_size)
    out += [f"model.{name}={value} must be a positive integer"
            for name, value in sizes.items() if value <= 0]
    if out:
      return out
    if self.block_types is not None and len(types) != self.num_layers:
      out.append(f"model.block_types has {len(types)} entries but model.num_layers="
                 f"{self.num_layers}")
    if self.has_attention:
      if self.width % self.num_heads:
        out.append(f"model.num_heads={self.num_heads} does not divide model.width="
                   f"{self.width}")
      elif self.head_dim % 4:
        out.append(f"model.width / model.num_heads = {self.head_dim} must be a multiple of 4 "
                   "(RoPE rotates half of each head in pairs)")
    if "recurrent" in types:
      lru, blocks = self.resolved_lru_width, self.resolved_gate_blocks
      if lru % blocks:
        out.append(f"model.num_gate_blocks (or num_heads) = {blocks} does not divide "
                   f"model.lru_width={lru}")
    if "gla" in types:
      heads = self.gla_num_heads or self.num_heads
      for name, expand in (("gla_expand_k", self.gla_expand_k),
                           ("gla_expand_v", self.gla_expand_v)):
        dim = self.width * expand
        if dim <= 0 or dim != int(dim) or int(dim) % heads:
          out.append(f"model.{name}={expand}: width*{expand}={dim} is not a positive "
                     f"multiple of the {heads} GLA heads")
    if self.param_dtype not in DTYPES:
      out.append(f"model.param_dtype={self.param_dtype!r} is not one of {'|'.join(DTYPES)}")
    if self.dtype not in DTYPES:
      out.append(f"model.dtype={self.dtype!r} is not one of {'|'.join(DTYPES)}")
    if self.attention_impl not in ATTENTION_IMPLS:
      out.append(f"model.attention_impl={self.attention_impl!r} is not one of "
                 f"{'|'.join(ATTENTION_IMPLS)}")
    elif self.attention_impl == "splash" and self.has_attention:
      problem = splash_attention_problem(self.dtype)
      if problem:
        out.append(f"model.attention_impl='splash' {problem} (use model.attention_impl=xla "
                   "or auto)")
    if not isinstance(self.fused_rg_lru, bool) and self.fused_rg_lru not in FUSED_RG_LRU:
      out.append(f"model.fused_rg_lru={self.fused_rg_lru!r} is not one of "
                 f"{'|'.join(FUSED_RG_LRU)}")
    choices = (("gate_impl", KERNEL_IMPLS),
               ("scan_impl", ("auto", "pallas", "xla_linear", "xla_associative")),
               ("mlp_impl", KERNEL_IMPLS), ("norm_impl", KERNEL_IMPLS),
               ("conv1d_impl", KERNEL_IMPLS), ("decode_impl", KERNEL_IMPLS),
               ("loss_impl", KERNEL_IMPLS), ("remat", REMAT_POLICIES))
    for name, allowed in choices:
      value = getattr(self, name)
      if value not in allowed:
        out.append(f"model.{name}={value!r} is not one of {'|'.join(allowed)}")
    if not isinstance(self.scan_layers, bool) and self.scan_layers not in SCAN_LAYERS:
      out.append(f"model.scan_layers={self.scan_layers!r} is not one of "
                 f"{'|'.join(SCAN_LAYERS)}")
    if not 0.0 < self.rg_lru_min_ac < self.rg_lru_max_ac < 1.0:
      out.append(f"model.rg_lru_min_ac={self.rg_lru_min_ac} and model.rg_lru_max_ac="
                 f"{self.rg_lru_max_ac} must satisfy 0 < min < max < 1")
    if not 0 <= self.logits_soft_cap < math.inf:
      out.append(f"model.logits_soft_cap={self.logits_soft_cap} must be >= 0 (0 disables it)")
    if self.loss_impl == "pallas" and not loss_kernels.supported(self.vocab_size):
      out.append(f"model.loss_impl='pallas' needs a model.vocab_size that is a multiple of 16, "
                 f"not {self.vocab_size} (use model.loss_impl=auto or xla)")
    return out


class GatedUpProjection(nnx.Module):
  """Both MLP branches in one ``[2, D, M]`` weight (the official layout)."""

  def __init__(self, width: int, expanded: int, *, rngs: nnx.Rngs, param_dtype):
    self.w = layers.param(rngs, layers.fan_in_normal(1.0, in_axis=1), (2, width, expanded),
                          param_dtype, (None, "embed", "mlp"))
    self.b = layers.zeros((2, 1, 1, expanded), param_dtype, (None, None, None, "mlp"))


class MLPBlock(nnx.Module):
  """Gated MLP: ``down(gelu(x W_0 + b_0) * (x W_1 + b_1))``, both branches ``D -> M``."""

  def __init__(self, width: int, expanded: int, *, rngs: nnx.Rngs, final_init_scale: float,
               param_dtype, dtype, impl: str = "xla"):
    self.dtype = dtype
    self.impl = impl
    self.ffw_up = GatedUpProjection(width, expanded, rngs=rngs, param_dtype=param_dtype)
    self.ffw_down = layers.Dense(expanded, width, axes=("mlp", "embed"), rngs=rngs,
                                 init_scale=final_init_scale, param_dtype=param_dtype,
                                 dtype=dtype)

  def __call__(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
    x = x.astype(self.dtype)
    # Branch axis next to the features ("btcm", not "cbtm"): one [B*T, D] x [D, 2M] matmul each
    # way, and the backward needs no transposes of [2, B, T, M] activations (measured on an
    # H100: they were 12% of a Griffin-1B step).
    w = self.ffw_up.w.value.astype(self.dtype)
    interpret = dispatch.triton_interpret()  # None on a TPU target: XLA's gating there
    if x.shape[1] == 1:  # decoding, one token per row (``gated_up``'s layout)
      up = gated_up.reference
      if (self.impl == "pallas" and interpret is not None
          and gated_up.worthwhile(x.shape[0], *w.shape[1:])):
        # One kernel that writes only the gated product, per device under a mesh where that
        # device's rows and share of the features are worth it.
        def local(x, w, b):
          if gated_up.worthwhile(x.shape[0], *w.shape[1:]):
            return gated_up.gated_up(x, w, b, interpret=interpret)
          return gated_up.reference(x, w, b)
        up = partitioning.shard_local(local, (("batch", None), (None, None, "mlp"), (None, "mlp")),
                                      ("batch", "mlp"))
      return self.ffw_down(up(x[:, 0], w, self.ffw_up.b.value.reshape(2, -1))[:, None])
    bias = self.ffw_up.b.value.astype(self.dtype)
    bias = bias.reshape(bias.shape[0], bias.shape[-1])
    up = jnp.einsum("btd,cdm->btcm", x, w)
    if self.impl == "pallas" and interpret is not None and mlp_kernels.supported(up.shape[-1]):
      # Per device under a mesh (rows over ``data``, features over ``model``).
      gating = functools.partial(mlp_kernels.gated_gelu, interpret=interpret)
      h = partitioning.shard_local(gating, (("batch", None, None, "mlp"), (None, "mlp")),
                                   ("batch", None, "mlp"))(up, bias)
      return self.ffw_down(h)
    up = up + bias
    return self.ffw_down(jax.nn.gelu(up[..., 0, :]) * up[..., 1, :])


def make_temporal_block(block_type: str, cfg: ModelConfig, rngs: nnx.Rngs, **kw):
  """The temporal-mixing block of one layer, by type name."""
  final = 2.0 / cfg.num_layers
  if block_type == "recurrent":
    return recurrent.RecurrentBlock(
        cfg.width, cfg.resolved_lru_width, cfg.resolved_gate_blocks, rngs=rngs,
        conv1d_temporal_width=cfg.conv1d_temporal_width, final_init_scale=final,
        scan_impl=cfg.scan_impl, fused_rg_lru=cfg.resolved_fused_rg_lru,
        gate_impl=cfg.resolved_gate_impl, conv1d_impl=cfg.resolved_conv1d_impl,
        decode_impl=cfg.resolved_decode_impl, a_init=(cfg.rg_lru_min_ac, cfg.rg_lru_max_ac),
        **kw)
  if block_type in ("attention", "global_attention"):
    window = cfg.attention_window_size if block_type == "attention" else None
    return attention.MQAttention(cfg.width, cfg.num_heads, window, rngs=rngs,
                                 final_init_scale=final, impl=cfg.resolved_attention_impl, **kw)
  if block_type == "gla":
    from recurrentgemma_jax import gla  # pylint: disable=g-import-not-at-top
    return gla.GLABlock(cfg, rngs=rngs, final_init_scale=final, **kw)
  raise ValueError(f"unknown block type {block_type!r}")


# Attribute name of each temporal block type inside a residual block (the official names).
TEMPORAL_NAMES = {"recurrent": "recurrent_block", "attention": "attention_block",
                  "global_attention": "attention_block", "gla": "gla_block"}


class ResidualBlock(nnx.Module):

  def __init__(self, block_type: str, cfg: ModelConfig, *, rngs: nnx.Rngs):
    kw = dict(param_dtype=DTYPES[cfg.param_dtype], dtype=DTYPES[cfg.dtype])
    self.block_type = block_type
    norm = dict(param_dtype=kw["param_dtype"], impl=cfg.resolved_norm_impl)
    self.temporal_pre_norm = layers.RMSNorm(cfg.width, **norm)
    setattr(self, TEMPORAL_NAMES[block_type], make_temporal_block(block_type, cfg, rngs, **kw))
    self.channel_pre_norm = layers.RMSNorm(cfg.width, **norm)
    self.mlp_block = MLPBlock(cfg.width, cfg.resolved_mlp_width, rngs=rngs,
                              impl=cfg.resolved_mlp_impl,
                              final_init_scale=2.0 / cfg.num_layers, **kw)

  @property
  def temporal(self):
    return getattr(self, TEMPORAL_NAMES[self.block_type])

  def __call__(self, x, segment_pos, cache=None):
    x, normed = self.temporal_pre_norm.with_skip(x)
    y, cache = self.temporal(normed, segment_pos, cache)
    x, normed = self.channel_pre_norm.with_skip(x + y.astype(x.dtype))
    x = x + self.mlp_block(normed).astype(x.dtype)
    return x, cache


def _block_forward(block: ResidualBlock, x, segment_pos):
  return block(x, segment_pos)[0]


# Logical name of the leading axis of layer-stacked parameters (``scan_layers``); never sharded.
LAYERS = "layers"


class Model(nnx.Module):
  """A Griffin / Hawk / MQA / GLA language model.

  Parameters: ``embedder``, the blocks, ``final_norm``. Unrolled (``scan_layers=False``), the
  blocks are ``blocks[i]``, one per layer. Scanned, ``stacked_blocks[g]`` is one block per
  position g of ``cfg.layer_pattern`` whose parameters hold layers ``g, g + P, g + 2P, ...``
  (P the pattern's length) on a leading ``layers`` axis, and ``tail_blocks[k]`` are the layers
  left after ``cfg.scan_repeats`` whole patterns; ``stack_layers`` and ``unstack_layers``
  convert one parameter tree into the other.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    errors = cfg.errors()
    if errors:
      raise ValueError("; ".join(errors))
    self.cfg = cfg
    types = cfg.resolved_block_types
    keys = _part_keys(rngs.params(), len(types))
    self.embedder = _embedder(cfg, keys[0])
    if cfg.layers_scanned:
      self.stacked_blocks = nnx.List([
          _stacked_block(cfg, t, jnp.stack([keys[1 + i] for i in stacked_layers(cfg, g)]))
          for g, t in enumerate(cfg.layer_pattern)])
      self.tail_blocks = nnx.List([_block(cfg, types[i], keys[1 + i]) for i in tail_layers(cfg)])
    else:
      self.blocks = nnx.List([_block(cfg, t, k) for t, k in zip(types, keys[1:])])
    self.final_norm = _final_norm(cfg)

  def __call__(
      self,
      tokens: Int[Array, "b t"],
      segment_pos: Int[Array, "b t"],
      *,
      upcast_logits: bool = True,
  ) -> Float[Array, "b t v"]:
    """Logits (float32) for the next token at every position; documents packed in a row are
    kept apart by ``segment_pos`` (0 at each document's first token). ``upcast_logits=False``
    (a model without a soft cap): the logits in the compute dtype, for a loss kernel that
    reads them as the output layer wrote them (``resolved_loss_impl``)."""
    x = self.embedder.encode(tokens)
    if self.cfg.remat == "none":
      forward = scanned_forward = _block_forward
    else:
      policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                if self.cfg.remat == "dots" else None)
      forward = nnx.remat(_block_forward, policy=policy)
      # (prevent_cse matters unrolled only: a scan already keeps XLA from merging the
      # recomputation into the forward pass.)
      scanned_forward = nnx.remat(_block_forward, policy=policy, prevent_cse=False)
    if self.cfg.layers_scanned:
      x = self._scan(scanned_forward, x, segment_pos)
    for block in self.tail_blocks if self.cfg.layers_scanned else self.blocks:
      x = forward(block, x, segment_pos)
    return self._logits(x, upcast_logits)

  def extend(
      self,
      tokens: Int[Array, "b t"],
      segment_pos: Int[Array, "b t"],
      cache: tuple,
  ) -> tuple[Float[Array, "b t v"], tuple]:
    """Logits of ``tokens`` following the tokens already in ``cache`` (prefill or decoding),
    and the updated cache. Equals the full forward on the whole sequence.

    Layer by layer, also with ``scan_layers`` (each layer a static slice of its stack): a scan
    over stacked caches copies each layer's cache in and out at every step, which made
    decoding 1.3B models on an H100 1.5x (Griffin) to 2.5x (MQA) slower."""
    x, cache = self._extend(tokens, segment_pos, cache)
    return self._logits(x), cache

  def greedy_extend(
      self,
      tokens: Int[Array, "b t"],
      segment_pos: Int[Array, "b t"],
      cache: tuple,
  ) -> tuple[Int[Array, "b"], tuple]:
    """``extend`` for greedy decoding: the argmax of the last position's logits (int32 ``[B]``)
    and the updated cache, without the logits. With ``decode_impl=pallas`` (``auto``: on GPUs),
    from ``greedy.MIN_ROWS`` rows a device, the output layer and the argmax run as one kernel
    that never writes the ``[B, V]`` logits (``pallas_kernels.sampling.greedy``: the same token
    as the argmax of the logits, bar near-ties within a bfloat16 rounding)."""
    x, cache = self._extend(tokens, segment_pos, cache)
    x = x[:, -1]
    table = self.embedder.input_embedding.value
    interpret = dispatch.triton_interpret()
    if not (self.cfg.resolved_decode_impl == "pallas" and interpret is not None
            and greedy.worthwhile(x.shape[0], *table.shape)):
      return jnp.argmax(self._logits(x), axis=-1).astype(jnp.int32), cache

    def local(x, table):  # per device under a mesh: rows over data, the vocabulary over model
      if greedy.worthwhile(x.shape[0], *table.shape):
        return greedy.partials(x, table, interpret=interpret)[:2]
      return greedy.partials_reference(x, table)

    x = self.final_norm(x).astype(self.embedder.dtype)
    best, column = partitioning.shard_local(
        local, (("batch", None), ("vocab", None)), (("batch", "vocab"), ("batch", "vocab")))(
            x, table.astype(x.dtype))
    return greedy.pick(best, column, table.shape[0] // best.shape[1]), cache

  def _extend(self, tokens, segment_pos, cache):
    """The last block's output for ``tokens`` after ``cache``, and the updated cache."""
    x = self.embedder.encode(tokens)
    new_cache = []
    for block, block_cache in zip(self._layers(), cache):
      x, block_cache = block(x, segment_pos, block_cache)
      new_cache.append(block_cache)
    return x, tuple(new_cache)

  def init_cache(self, batch_size: int, max_len: int) -> tuple:
    """Empty decoding caches, one per block: constant size for recurrent and GLA blocks, the
    window for local attention, ``max_len`` tokens for global attention."""
    dtype = DTYPES[self.cfg.dtype]
    return tuple(block.temporal.init_cache(batch_size, max_len, dtype)
                 for block in self._layers())

  def _layers(self) -> list[ResidualBlock]:
    """Every layer's block, in order (with ``scan_layers``, slices of the stacks)."""
    if not self.cfg.layers_scanned:
      return list(self.blocks)
    by_index = dict(zip(tail_layers(self.cfg), self.tail_blocks))
    for g, stack in enumerate(self.stacked_blocks):
      graphdef, state = nnx.split(stack)
      state = _without_layer_axis(state)
      for j, i in enumerate(stacked_layers(self.cfg, g)):
        by_index[i] = nnx.merge(graphdef, jax.tree.map(lambda x, j=j: x[j], state))
    return [by_index[i] for i in range(len(self.cfg.resolved_block_types))]

  def _scan(self, forward, x, segment_pos):
    """``x`` through ``cfg.scan_repeats`` runs of the layer pattern: one ``lax.scan`` over the
    stacked parameters, ``forward(block, x, segment_pos)`` for each block of a run."""
    graphdef, stacked = nnx.split(self.stacked_blocks)
    stacked = _without_layer_axis(stacked)  # (the metadata of the slices the scan takes)

    def body(x, params):
      for block in nnx.merge(graphdef, params):
        x = forward(block, x, segment_pos)
      return x, None

    return jax.lax.scan(body, x, stacked)[0]

  def _logits(self, x, upcast: bool = True):
    logits = self.embedder.decode(self.final_norm(x))
    if not upcast and not self.cfg.logits_soft_cap:
      return logits
    logits = logits.astype(layers.accumulation_dtype(logits.dtype))
    if self.cfg.logits_soft_cap:
      cap = self.cfg.logits_soft_cap
      logits = jnp.tanh(logits / cap) * cap
    return logits


def _part_keys(key, num_blocks: int) -> list:
  """One key for the embedder, then one per block: each part's values depend only on its
  own key, so a part initialised alone equals the same part of the whole model."""
  return [jax.random.fold_in(key, i) for i in range(num_blocks + 1)]


def _embedder(cfg: ModelConfig, key) -> layers.Embedder:
  return layers.Embedder(cfg.vocab_size, cfg.width,
                         scale_by_sqrt_dim=cfg.embeddings_scale_by_sqrt_dim,
                         rngs=nnx.Rngs(params=key), param_dtype=DTYPES[cfg.param_dtype],
                         dtype=DTYPES[cfg.dtype])


def _block(cfg: ModelConfig, block_type: str, key) -> ResidualBlock:
  return ResidualBlock(block_type, cfg, rngs=nnx.Rngs(params=key))


def _stacked_block(cfg: ModelConfig, block_type: str, keys) -> ResidualBlock:
  """One block per key (``vmap`` of ``_block``: each layer's values are those it has
  unrolled), as one block whose parameters carry the layers on a leading ``layers`` axis."""
  graphdefs = []

  def one(key):
    graphdef, state = nnx.split(_block(cfg, block_type, key))
    graphdefs.append(graphdef)
    return state

  state = jax.tree.map(lambda v: v.replace(axes=(LAYERS, *v.get_metadata()["axes"])),
                       jax.vmap(one)(keys), is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdefs[0], state)


def _without_layer_axis(state):
  """A State of stacked parameters whose ``axes`` metadata is one layer's (for slices)."""
  return jax.tree.map(lambda v: v.replace(axes=v.get_metadata()["axes"][1:]), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def stacked_layers(cfg: ModelConfig, position: int) -> range:
  """The layers (block indices) stacked in ``stacked_blocks[position]``."""
  pattern = len(cfg.layer_pattern)
  return range(position, cfg.scan_repeats * pattern, pattern)


def tail_layers(cfg: ModelConfig) -> range:
  """The layers after the scan (``tail_blocks``): those left over from whole patterns."""
  return range(cfg.scan_repeats * len(cfg.layer_pattern), len(cfg.resolved_block_types))


def _final_norm(cfg: ModelConfig) -> layers.RMSNorm:
  return layers.RMSNorm(cfg.width, param_dtype=DTYPES[cfg.param_dtype])


def init_model(cfg: ModelConfig, seed: int = 0) -> Model:
  return Model(cfg, rngs=nnx.Rngs(params=seed))


def init_params(cfg: ModelConfig, seed: int = 0, shardings=None) -> nnx.State:
  """``nnx.state(init_model(cfg, seed))``, the same values, created on device (with
  ``shardings``, the parameter State's NamedShardings, each array made sharded).

  One jitted program per part (embedder, each kind of block, final norm) rather than one
  for the whole model: blocks of one kind share their compiled program, so the compile time
  no longer grows with depth. (A single program over all 24 blocks of GLA 340M compiled for
  more than 8 minutes on an H100, and takes about 1 s per block on the CPU.) With
  ``scan_layers`` each stack of layers is one program that vmaps a block's initialisation over
  the layers' keys: the same values as unrolled, layer by layer.
  """
  model = nnx.eval_shape(lambda: init_model(cfg, seed))
  types = cfg.resolved_block_types
  keys = _part_keys(nnx.Rngs(params=seed).params(), len(types))
  sharding = lambda *path: None if shardings is None else functools.reduce(
      lambda sub, name: sub[name], path, shardings)
  programs = {}

  def made(kind, build, out_shardings, *args):
    """build(*args)'s parameters, through one jitted program per kind and sharding."""
    signature = (kind, tuple(jax.tree.leaves(out_shardings)))
    if signature not in programs:
      programs[signature] = jax.jit(lambda *a: nnx.state(build(*a)),
                                    out_shardings=out_shardings)
    return programs[signature](*args)

  def block(blocks, name, k, i):
    nnx.update(blocks[k], made(types[i], functools.partial(_block, cfg, types[i]),
                               sharding(name, k), keys[1 + i]))

  nnx.update(model.embedder,
             made("embedder", functools.partial(_embedder, cfg), sharding("embedder"), keys[0]))
  if cfg.layers_scanned:
    for g, block_type in enumerate(cfg.layer_pattern):
      layer_keys = jnp.stack([keys[1 + i] for i in stacked_layers(cfg, g)])
      nnx.update(model.stacked_blocks[g],
                 made(("stacked", block_type), functools.partial(_stacked_block, cfg, block_type),
                      sharding("stacked_blocks", g), layer_keys))
    for k, i in enumerate(tail_layers(cfg)):
      block(model.tail_blocks, "tail_blocks", k, i)
  else:
    for i in range(len(types)):
      block(model.blocks, "blocks", i, i)
  nnx.update(model.final_norm,
             made("final_norm", functools.partial(_final_norm, cfg), sharding("final_norm")))
  return nnx.state(model)


def stack_layers(tree: dict, cfg: ModelConfig) -> dict:
  """A parameter tree in the per-layer layout (``blocks/i``: the unrolled model's, the
  importer's) -> the scanned layout of ``cfg`` (``stacked_blocks/g``, ``tail_blocks/k``; see
  ``Model``). ``tree`` is a nested dict (``nnx.to_pure_dict``) of arrays or ShapeDtypeStructs
  (whose shardings gain an unsharded leading axis); parts other than the blocks pass through.
  """
  tree = dict(tree)
  blocks = {int(i): block for i, block in tree.pop("blocks").items()}
  tree["stacked_blocks"] = {
      g: jax.tree.map(lambda *group: _stack(group), *(blocks[i] for i in stacked_layers(cfg, g)))
      for g in range(len(cfg.layer_pattern))}
  if tail_layers(cfg):  # (an empty List has no entry in the State)
    tree["tail_blocks"] = {k: blocks[i] for k, i in enumerate(tail_layers(cfg))}
  return tree


def unstack_layers(tree: dict, cfg: ModelConfig) -> dict:
  """The inverse of ``stack_layers``: a scanned parameter tree -> the per-layer layout."""
  tree = dict(tree)
  stacked = {int(g): group for g, group in tree.pop("stacked_blocks").items()}
  tail = {int(k): block for k, block in tree.pop("tail_blocks", {}).items()}
  blocks = {}
  for g, group in stacked.items():
    for j, i in enumerate(stacked_layers(cfg, g)):
      blocks[i] = jax.tree.map(lambda x, j=j: _layer(x, j), group)
  for k, i in enumerate(tail_layers(cfg)):
    blocks[i] = tail[k]
  tree["blocks"] = {i: blocks[i] for i in range(len(cfg.resolved_block_types))}
  return tree


def _stack(group: tuple):
  """Arrays (or ShapeDtypeStructs) of the same parameter of several layers, stacked."""
  first = group[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    sharding = first.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = sharding.update(spec=jax.sharding.PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(group), *first.shape), first.dtype, sharding=sharding)
  return jnp.stack(group)


def _layer(x, j: int):
  """Layer ``j`` of a stacked array (or ShapeDtypeStruct)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = sharding.update(spec=jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
  return x[j]


def count_params(cfg: ModelConfig) -> int:
  """Number of parameters, from shapes only (``jax.eval_shape``: nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: init_model(cfg))
  state = nnx.state(abstract, nnx.Param)
  return sum(int(x.size) for x in jax.tree.leaves(state))
