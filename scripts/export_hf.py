"""Exports a griffin or hawk checkpoint to a HuggingFace transformers RecurrentGemma directory.

  python scripts/export_hf.py --checkpoint DIR --dst OUT [--dtype bfloat16|float32] \
      [--max_shard_bytes=5000000000]

``DIR`` is an imported checkpoint or a training workdir (its latest checkpoint), with layers
stacked (``model.scan_layers``) or not. ``OUT`` gets what ``RecurrentGemmaForCausalLM.
from_pretrained`` loads: ``config.json``, the weights in safetensors (split into shards of at
most ``--max_shard_bytes`` with ``model.safetensors.index.json`` when larger) and the
SentencePiece ``tokenizer.model`` recorded with the checkpoint, if any. ``--dtype`` defaults to
the checkpoint's parameter dtype. What transformers' model cannot express (the mqa and gla
families, global attention, gate blocks other than the heads, no embedding scaling or logit
cap) is refused with one line; ``recurrentgemma_jax/hf.py`` has the mapping.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="checkpoint or training workdir")
  parser.add_argument("--dst", required=True, help="output directory (must not exist)")
  parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                      help="dtype of the exported weights (default: the checkpoint's)")
  parser.add_argument("--max_shard_bytes", type=int, default=5 * 10**9,
                      help="largest safetensors file before splitting into shards")
  args = parser.parse_args(argv)
  cli.quiet_background_failures()  # (a damaged checkpoint: its one line, not Orbax's pages)

  with cli.user_errors():
    from recurrentgemma_jax import hf  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax.errors import CheckpointError  # pylint: disable=g-import-not-at-top

    if os.path.exists(args.dst):
      raise CheckpointError(f"--dst {args.dst!r} already exists; choose a new directory")
    if args.max_shard_bytes <= 0:
      raise CheckpointError(f"--max_shard_bytes={args.max_shard_bytes} must be > 0")
    cfg, files = hf.export_checkpoint(args.checkpoint, args.dst, dtype=args.dtype,
                                      max_shard_bytes=args.max_shard_bytes)
    print(f"exported {cfg.num_layers} blocks "
          f"({''.join(t[0].upper() for t in cfg.resolved_block_types)}), width {cfg.width}, "
          f"window {cfg.attention_window_size} (transformers' attention_window_size "
          f"{cfg.attention_window_size + 1}) -> {args.dst}: {', '.join(files)}")


if __name__ == "__main__":
  main()
