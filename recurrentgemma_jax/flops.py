"""Training FLOPs per token for each block type, and device peak FLOP/s, for MFU.

Counted (multiply-add = 2 FLOPs; training = 3x forward: forward, input grads, weight grads):

- every matmul weight ``w`` applied to each token: ``2 * w.size`` forward, including the output
  layer (``vocab * D``; the embedding lookup itself is free);
- attention scores and values: ``2 * 2 * heads * head_dim * keys`` forward per token, where
  ``keys`` is the mean number of keys a query sees: ``(T + 1) / 2`` for global causal attention,
  and for a local window ``W`` the mean of ``min(t + 1, W + 1)`` over positions ``t < T``;
- GLA: per token and head, ``2 * K * V`` for the state update and ``2 * K * V`` for the output
  (the chunkwise form does more work than this recurrent count; MFU uses the model's FLOPs,
  not the implementation's);
- RG-LRU, Conv1D, norms and other elementwise work are not counted (under 1% at the paper sizes).

MFU = FLOPs per token x tokens per second / peak FLOP/s of all devices.
"""

from __future__ import annotations

import jax

from recurrentgemma_jax import model as model_lib

# Dense bfloat16 peak FLOP/s per chip (vendor figures, no sparsity).
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM (device kind "NVIDIA H100 80GB HBM3")
    "H200": 989e12,
}


def device_peak_flops(device: jax.Device | None = None) -> float | None:
  """Peak bfloat16 FLOP/s of one device, or None when the kind is not in the table."""
  kind = (device or jax.devices()[0]).device_kind
  for name in sorted(PEAK_FLOPS, key=len, reverse=True):  # most specific name first
    if name.lower() in kind.lower():
      return PEAK_FLOPS[name]
  return None


def _mean_keys(seq_len: int, window: int | None) -> float:
  if window is None or window + 1 >= seq_len:
    return (seq_len + 1) / 2
  w = window + 1
  # positions 0..w-1 see t+1 keys, the rest see w keys
  return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def forward_flops_per_token(cfg: model_lib.ModelConfig, seq_len: int) -> float:
  d, lru, mlp = cfg.width, cfg.resolved_lru_width, cfg.resolved_mlp_width
  total = 2 * cfg.vocab_size * d  # output layer
  for block_type in cfg.resolved_block_types:
    total += 2 * 3 * d * mlp  # gated MLP: two up branches and one down
    if block_type == "recurrent":
      total += 2 * (3 * d * lru + 2 * lru * lru // cfg.resolved_gate_blocks)
    elif block_type in ("attention", "global_attention"):
      window = cfg.attention_window_size if block_type == "attention" else None
      total += 2 * (2 * d * d + 2 * d * cfg.head_dim)  # q, out; k, v (one head)
      total += 2 * 2 * d * _mean_keys(seq_len, window)  # heads * head_dim = d
    elif block_type == "gla":
      heads = cfg.gla_num_heads or cfg.num_heads
      k_dim, v_dim = int(d * cfg.gla_expand_k), int(d * cfg.gla_expand_v)
      total += 2 * (d * (2 * k_dim + 2 * v_dim) + v_dim * d)  # q, k, v, gate; out
      total += 2 * (d * cfg.gla_gate_rank + cfg.gla_gate_rank * k_dim)  # low-rank forget gate
      total += 2 * 2 * k_dim * v_dim // heads  # state update and readout
  return float(total)


def train_flops_per_token(cfg: model_lib.ModelConfig, seq_len: int) -> float:
  return 3.0 * forward_flops_per_token(cfg, seq_len)
