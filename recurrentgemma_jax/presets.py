"""Named model sizes: the Griffin paper's Table 2 (shared by griffin, hawk and mqa), the GLA
paper's 340M and 1.3B, and RecurrentGemma 2B / 9B.

Paper models: head dimension 128 (heads = D / 128), MLP expansion 3, local attention window
1024, 16 block-diagonal RG-LRU gate blocks, no embedding scaling, no logit cap.
RecurrentGemma: window 2048, gate blocks = heads, ``sqrt(D)`` embedding scaling, logit cap 30.
``vocab_size`` is left to the run config (it must match the tokenizer).

    python -m recurrentgemma_jax.presets   # prints the parameter table of docs/models.md
"""

from __future__ import annotations

from recurrentgemma_jax import model as model_lib

# size: (width D, RNN width D_RNN, depth N, attention heads)  -- Griffin paper, Table 2.
PAPER_SIZES = {
    "100m": (768, 1024, 12, 6),
    "200m": (1024, 1536, 12, 8),
    "400m": (1536, 2048, 12, 12),
    "1.3b": (2048, 2560, 24, 16),
    "3b": (3072, 4096, 24, 24),
    "7b": (4096, 5632, 32, 32),
    "14b": (5120, 8192, 40, 40),
}
# GLA paper (Yang et al. 2023), section 5: 24 layers, 4 heads, expand_k 0.5, expand_v 1.
GLA_SIZES = {"340m": (1024, 24, 4), "1.3b": (2048, 24, 4)}


def preset(family: str, size: str) -> dict:
  """The ``model`` config fields of a named size (a plain dict, to update a ConfigDict)."""
  if family == "recurrentgemma":
    if size not in ("2b", "9b"):
      raise KeyError(f"recurrentgemma size {size!r} is not one of 2b|9b")
    width, heads, layers = (2560, 10, 26) if size == "2b" else (4096, 16, 38)
    return dict(family="griffin", width=width, lru_width=width, num_layers=layers,
                num_heads=heads, mlp_expanded_width=3 * width, num_gate_blocks=heads,
                attention_window_size=2048, embeddings_scale_by_sqrt_dim=True,
                logits_soft_cap=30.0)
  if family == "gla":
    if size not in GLA_SIZES:
      raise KeyError(f"gla size {size!r} is not one of {'|'.join(GLA_SIZES)}")
    width, layers, heads = GLA_SIZES[size]
    return dict(family="gla", width=width, num_layers=layers, num_heads=heads,
                gla_num_heads=heads, mlp_expanded_width=3 * width,
                embeddings_scale_by_sqrt_dim=False, logits_soft_cap=0.0)
  if family not in ("griffin", "hawk", "mqa"):
    raise KeyError(f"family {family!r} is not one of griffin|hawk|mqa|gla|recurrentgemma")
  if size not in PAPER_SIZES:
    raise KeyError(f"{family} size {size!r} is not one of {'|'.join(PAPER_SIZES)}")
  width, lru_width, layers, heads = PAPER_SIZES[size]
  return dict(family=family, width=width, lru_width=lru_width, num_layers=layers,
              num_heads=heads, mlp_expanded_width=3 * width, num_gate_blocks=16,
              attention_window_size=1024, embeddings_scale_by_sqrt_dim=False,
              logits_soft_cap=0.0)


def all_presets() -> list[tuple[str, str]]:
  names = [(f, s) for f in ("griffin", "hawk", "mqa") for s in PAPER_SIZES]
  names += [("gla", s) for s in GLA_SIZES]
  return names + [("recurrentgemma", "2b"), ("recurrentgemma", "9b")]


def table(vocab_size: int = 256_000) -> str:
  """Markdown table of every preset with its parameter count (from shapes only)."""
  rows = ["| family | size | D | D_RNN | depth | heads | blocks | params | non-embedding |",
          "|---|---|---|---|---|---|---|---|---|"]
  for family, size in all_presets():
    fields = preset(family, size)
    cfg = model_lib.ModelConfig(vocab_size=vocab_size, **fields)
    total = model_lib.count_params(cfg)
    embedding = vocab_size * cfg.width
    pattern = "".join({"recurrent": "R", "attention": "A", "global_attention": "G",
                       "gla": "L"}[t] for t in cfg.resolved_block_types[:3])
    rnn = cfg.resolved_lru_width if family != "gla" else "-"
    rows.append(f"| {family} | {size} | {cfg.width} | {rnn} | {cfg.num_layers} | "
                f"{cfg.num_heads} | {pattern}... | {total / 1e9:.3f}B | "
                f"{(total - embedding) / 1e9:.3f}B |")
  return "\n".join(rows)


if __name__ == "__main__":
  print(table())
