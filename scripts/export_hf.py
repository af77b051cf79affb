"""Exports a griffin or hawk checkpoint to a HuggingFace transformers RecurrentGemma directory.

  python scripts/export_hf.py --checkpoint DIR --dst OUT [--dtype bfloat16|float32] \
      [--max_shard_bytes=5000000000]

``DIR`` is an imported checkpoint or a training workdir (its latest readable step), with layers
stacked (``model.scan_layers``) or not. ``OUT`` gets what ``RecurrentGemmaForCausalLM.
from_pretrained`` loads: ``config.json``, the weights in safetensors (split into shards of at
most ``--max_shard_bytes`` with ``model.safetensors.index.json`` when larger) and the
SentencePiece ``tokenizer.model`` recorded with the checkpoint (one that cannot be found is
left out, with a warning line). ``--dtype`` defaults to the checkpoint's parameter dtype.

Only RecurrentGemma's settings export: ``model.family`` griffin or hawk with local attention
only, ``model.num_gate_blocks`` equal to ``model.num_heads`` (or 0) where there is attention,
``model.embeddings_scale_by_sqrt_dim=true`` and ``model.logits_soft_cap`` > 0, as in
configs/recurrentgemma.py and imported checkpoints. The Griffin paper's presets and
configs/default.py have neither the scaling nor the cap: a run of them exports when trained
with ``--config.model.embeddings_scale_by_sqrt_dim=true --config.model.logits_soft_cap=30``
(a griffin or hawk preset: hawk any size; griffin 200m, 1.3b and 7b, whose heads divide the
LRU width, with ``--config.model.num_gate_blocks=0`` too). Anything else is refused with one
line naming every setting in the way; ``recurrentgemma_jax/hf.py`` has the mapping.
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
          f"{cfg.attention_window_size + 1}) -> {args.dst}: "
          + (", ".join(files) if len(files) <= 4 else
             f"{len(files)} files ({sum(f.endswith('.safetensors') for f in files)} shards)"))


if __name__ == "__main__":
  main()
