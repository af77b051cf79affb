"""Turns an official RecurrentGemma or a HuggingFace transformers checkpoint into ours.

  python scripts/import_recurrentgemma.py --src /path/to/2b --dst /path/to/out \
      [--attention_window_size=2048] [--logits_soft_cap=30] [--embeddings_scale_by_sqrt_dim=true]

The format of ``--src`` is detected:

- the bare Orbax parameter tree the official checkpoints are distributed as: the architecture
  (width, LRU width, MLP width, heads, gate blocks, block pattern) is read from the parameter
  shapes; the flags give what shapes cannot tell, defaulting to RecurrentGemma's values;
- a transformers directory (``config.json`` with ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``, as on the HuggingFace hub): the architecture comes from
  ``config.json`` (the flags do not apply), the tensors are read one at a time, and a
  ``tokenizer.model`` beside them is taken as ``--tokenizer`` (a byte-level model that
  export_hf.py wrote records ``byte``).

Either way the output holds the parameters per layer, in bfloat16 when the source's are all
bfloat16, else float32, and a ``--tokenizer`` file is copied into ``--dst`` as
``tokenizer.model`` and recorded by its absolute path, so sampling works from any directory.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top

# What the flags default to for an official checkpoint (RecurrentGemma's values).
OFFICIAL_DEFAULTS = {"attention_window_size": 2048, "logits_soft_cap": 30.0,
                     "embeddings_scale_by_sqrt_dim": True}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--src", required=True,
                      help="official Orbax parameter checkpoint or transformers directory")
  parser.add_argument("--dst", required=True, help="output directory (must not exist)")
  # (official checkpoints only; unset: OFFICIAL_DEFAULTS)
  parser.add_argument("--attention_window_size", type=int, default=None, help="default 2048")
  parser.add_argument("--logits_soft_cap", type=float, default=None, help="default 30")
  parser.add_argument("--embeddings_scale_by_sqrt_dim", type=cli.parse_bool, default=None,
                      help="default true")
  parser.add_argument("--tokenizer", default=None,
                      help="SentencePiece model to copy into --dst and record (optional; "
                      "'byte' for a byte-level model)")
  args = parser.parse_args(argv)
  cli.quiet_background_failures()  # (a damaged checkpoint: its one line, not Orbax's pages)
  given = {name: getattr(args, name) for name in OFFICIAL_DEFAULTS
           if getattr(args, name) is not None}

  with cli.user_errors():
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax import checkpoint, hf, official  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax.errors import CheckpointError  # pylint: disable=g-import-not-at-top

    src = os.path.abspath(args.src)
    if not os.path.isdir(src):
      raise CheckpointError(f"--src {args.src!r} is not a directory")
    if os.path.exists(args.dst):
      raise CheckpointError(f"--dst {args.dst!r} already exists; choose a new directory")
    if args.tokenizer not in (None, "byte") and not os.path.isfile(args.tokenizer):
      raise CheckpointError(f"--tokenizer {args.tokenizer!r} is not a file")
    if checkpoint.is_ours(src):
      raise CheckpointError(f"--src {args.src!r} is already a recurrentgemma_jax checkpoint "
                            "(or training workdir): sample, evaluate or export it as it is")
    if hf.is_hf_dir(src):
      if given:
        raise CheckpointError(f"--{next(iter(given))} applies to official checkpoints; --src "
                              f"{args.src!r} is a transformers directory, whose config.json "
                              "sets it")
      cfg = hf.import_checkpoint(src, args.dst, tokenizer=args.tokenizer)
      _report(cfg, "a transformers", args.dst)
      return
    flags = OFFICIAL_DEFAULTS | given
    if flags["attention_window_size"] <= 0:
      raise CheckpointError(f"--attention_window_size={args.attention_window_size} must be > 0")
    import warnings  # pylint: disable=g-import-not-at-top
    try:
      with warnings.catch_warnings():  # (Orbax's note on sharding, irrelevant for a bare tree)
        warnings.filterwarnings("ignore", message="Sharding info not provided")
        tree = ocp.PyTreeCheckpointer().restore(src)
    except Exception as e:  # Orbax raises many types for a damaged checkpoint.
      raise CheckpointError(f"--src {args.src!r} is not a readable Orbax checkpoint: "
                            f"{cli.first_line(e)}") from None
    if not isinstance(tree, dict):
      raise CheckpointError(f"--src {args.src!r} does not hold a parameter tree")
    try:
      cfg = official.infer_config(tree, **flags)
    except CheckpointError as e:
      raise CheckpointError(f"--src {args.src!r}: {e}") from None
    errors = cfg.errors()
    if errors:
      raise CheckpointError(f"--src {args.src!r}: inferred architecture is invalid: {errors[0]}")
    checkpoint.save_model(args.dst, official.convert_params(tree), cfg, tokenizer=args.tokenizer)
    _report(cfg, "an official", args.dst)


def _report(cfg, source: str, dst: str) -> None:
  print(f"imported {cfg.num_layers} blocks ({''.join(t[0].upper() for t in cfg.block_types)})"
        f" from {source} checkpoint, width {cfg.width}, lru_width {cfg.resolved_lru_width},"
        f" vocab {cfg.vocab_size}, window {cfg.attention_window_size}, {cfg.param_dtype}"
        f" -> {dst}")


if __name__ == "__main__":
  main()
