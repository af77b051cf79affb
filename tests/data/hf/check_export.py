"""Loads an exported directory with transformers and compares its logits with reference logits.

Run with torch and transformers (the environment of make_checkpoints.py), once per export;
docs/models.md has the commands and the figures:

  /tmp/hfenv/bin/python tests/data/hf/check_export.py --hf_dir OUT \
      --tokens tests/data/hf/griffin/tokens.npy --logits tests/data/hf/griffin/logits.npy

``--tokens``: int32 ``[N, T]``; ``--logits``: float32 ``[N, T, V]`` (transformers' own logits of
the model that was imported and exported again, or the official package's). Prints the largest
absolute difference; exits 1 when it is above ``--atol``.
"""

import argparse
import sys

import numpy as np
import torch
import transformers


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hf_dir", required=True)
  parser.add_argument("--tokens", required=True)
  parser.add_argument("--logits", required=True)
  parser.add_argument("--atol", type=float, default=1e-4)
  args = parser.parse_args()

  model = transformers.RecurrentGemmaForCausalLM.from_pretrained(
      args.hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
  tokens = np.load(args.tokens)
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens).long(), use_cache=False).logits.float().numpy()
  want = np.load(args.logits)
  diff = float(np.abs(logits - want).max())
  print(f"transformers {transformers.__version__}, torch {torch.__version__}: {args.hf_dir}: "
        f"logits {list(logits.shape)}, max |diff| {diff:.3g} (largest |logit| "
        f"{float(np.abs(want).max()):.3g})")
  sys.exit(0 if diff <= args.atol else 1)


if __name__ == "__main__":
  main()
