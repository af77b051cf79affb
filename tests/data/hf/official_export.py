"""Writes an official RecurrentGemma checkpoint's transformers export and the official logits.

Run in the project's environment (jax and the official ``recurrentgemma`` package), then
compare with transformers in the environment of make_checkpoints.py:

  python3 tests/data/hf/official_export.py --out /tmp/official_hf
  /tmp/hfenv/bin/python tests/data/hf/check_export.py --hf_dir /tmp/official_hf/hf \
      --tokens /tmp/official_hf/tokens.npy --logits /tmp/official_hf/logits.npy

It builds the small official models of tests/test_official_parity.py (every parameter
perturbed; patterns RRA and ARR, window 5, ``lru_width`` 64 != width 48), saves each as the
bare Orbax tree the official checkpoints are distributed as, imports it with
``scripts/import_recurrentgemma.py``, exports that with ``scripts/export_hf.py`` and stores the
official package's float32 logits for rows longer than the window. docs/models.md has the
figures.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
from recurrentgemma import jax as rg  # pylint: disable=g-import-not-at-top

from test_official_parity import official_logits, official_model_and_params  # pylint: disable=g-import-not-at-top


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="output directory (must not exist)")
  args = parser.parse_args()
  os.makedirs(args.out)
  for pattern in ("RRA", "ARR"):
    out = os.path.join(args.out, pattern)
    block_types = [{"R": rg.TemporalBlockType.RECURRENT,
                    "A": rg.TemporalBlockType.ATTENTION}[c] for c in pattern]
    model, params = official_model_and_params(block_types, seed=len(pattern))
    ocp.PyTreeCheckpointer().save(os.path.join(out, "official"), params)
    for script, *flags in (
        ("import_recurrentgemma.py", f"--src={out}/official", f"--dst={out}/imported",
         "--attention_window_size=5"),
        ("export_hf.py", f"--checkpoint={out}/imported", f"--dst={out}/hf")):
      subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *flags],
                     check=True)
    tokens = np.random.default_rng(0).integers(0, 101, size=(3, 17)).astype(np.int32)
    np.save(os.path.join(out, "tokens.npy"), tokens)
    np.save(os.path.join(out, "logits.npy"),
            np.asarray(official_logits(model, params, jnp.asarray(tokens)), np.float32))
    print(f"{pattern}: {out}/hf, {out}/tokens.npy, {out}/logits.npy")


if __name__ == "__main__":
  main()
