"""Turns an official RecurrentGemma Flax checkpoint into a checkpoint the scripts here load.

  python scripts/import_recurrentgemma.py --src /path/to/2b --dst /path/to/out \
      [--attention_window_size=2048] [--logits_soft_cap=30] [--embeddings_scale_by_sqrt_dim=true]

``--src`` is the bare Orbax parameter tree the official checkpoints are distributed as. The
architecture (width, LRU width, MLP width, heads, gate blocks, block pattern) is read from the
parameter shapes; the flags give what shapes cannot tell, defaulting to RecurrentGemma's values.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--src", required=True, help="official Orbax parameter checkpoint")
  parser.add_argument("--dst", required=True, help="output directory (must not exist)")
  parser.add_argument("--attention_window_size", type=int, default=2048)
  parser.add_argument("--logits_soft_cap", type=float, default=30.0)
  parser.add_argument("--embeddings_scale_by_sqrt_dim", type=cli.parse_bool, default=True)
  parser.add_argument("--tokenizer", default=None,
                      help="SentencePiece model to record with the checkpoint (optional)")
  args = parser.parse_args(argv)

  with cli.user_errors():
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax import checkpoint, official  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax.errors import CheckpointError  # pylint: disable=g-import-not-at-top

    src = os.path.abspath(args.src)
    if not os.path.isdir(src):
      raise CheckpointError(f"--src {args.src!r} is not a directory")
    if os.path.exists(args.dst):
      raise CheckpointError(f"--dst {args.dst!r} already exists; choose a new directory")
    if args.attention_window_size <= 0:
      raise CheckpointError(f"--attention_window_size={args.attention_window_size} must be > 0")
    try:
      tree = ocp.PyTreeCheckpointer().restore(src)
    except Exception as e:  # Orbax raises many types for a damaged checkpoint.
      raise CheckpointError(f"--src {args.src!r} is not a readable Orbax checkpoint: "
                            f"{cli.first_line(e)}") from None
    if not isinstance(tree, dict):
      raise CheckpointError(f"--src {args.src!r} does not hold a parameter tree")
    cfg = official.infer_config(
        tree, attention_window_size=args.attention_window_size,
        logits_soft_cap=args.logits_soft_cap,
        embeddings_scale_by_sqrt_dim=args.embeddings_scale_by_sqrt_dim)
    errors = cfg.errors()
    if errors:
      raise CheckpointError(f"--src {args.src!r}: inferred architecture is invalid: {errors[0]}")
    checkpoint.save_model(args.dst, official.convert_params(tree), cfg, tokenizer=args.tokenizer)
    print(f"imported {cfg.num_layers} blocks ({''.join(t[0].upper() for t in cfg.block_types)}),"
          f" width {cfg.width}, lru_width {cfg.resolved_lru_width}, vocab {cfg.vocab_size}"
          f" -> {args.dst}")


if __name__ == "__main__":
  main()
