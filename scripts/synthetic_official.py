"""A control for `scripts/synthetic.py`: trains the *official* RecurrentGemma model code
(``recurrentgemma.jax.Griffin``: its own initialisation and forward pass) on the same synthetic
rows, with the same optimizer and schedule (``train.make_optimizer``), loss and held-out
accuracy. Where our model and the official one learn alike, a result is the recipe's, not a
defect of our model.

  python scripts/synthetic_official.py --task selective_copying --model hawk --out DIR \
      [--steps N] [--time_limit SECONDS] [--eval_rows 256] [--lengths L1,L2,...] [--tiny] \
      [--config.FIELD=VALUE ...]   (fields of configs/synthetic.py, as for train.py)

Writes ``DIR/metrics.jsonl``: ``{"step", "loss"}`` every ``log_every`` steps,
``{"step", "eval_accuracy"}`` every ``eval_every`` steps and, at the end,
``{"step", "accuracy_at_length": {L: accuracy}}`` for the ``--lengths`` (default: the training
length). The official package is installed
with ``pip install --no-deps recurrentgemma==1.0.1``.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# (first: on a machine without an accelerator it picks JAX's CPU backend before jax is imported)
from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top,unused-import

import jax  # pylint: disable=g-import-not-at-top,g-bad-import-order
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np  # pylint: disable=g-import-not-at-top,g-bad-import-order

from recurrentgemma_jax import configlib, train  # pylint: disable=g-import-not-at-top
from recurrentgemma_jax.data import synthetic  # pylint: disable=g-import-not-at-top
from synthetic import MODELS, TASKS, config_spec  # pylint: disable=g-import-not-at-top


def official_model(config):
  import recurrentgemma.jax as rg  # pylint: disable=g-import-not-at-top
  kinds = {"recurrent": rg.TemporalBlockType.RECURRENT,
           "attention": rg.TemporalBlockType.ATTENTION,
           "global_attention": rg.TemporalBlockType.ATTENTION}
  m = config.model
  names = m.block_types.split(",")
  # The official code has local attention only; a window of the whole row is global attention.
  window = config.seq_len if "global_attention" in names else m.attention_window_size
  cfg = rg.GriffinConfig(
      vocab_size=synthetic.FIRST_SYMBOL + config.data.synthetic.vocab_size, width=m.width,
      mlp_expanded_width=m.mlp_expanded_width, num_heads=m.num_heads, lru_width=m.lru_width,
      block_types=tuple(kinds[n] for n in names), attention_window_size=window,
      embeddings_scale_by_sqrt_dim=m.embeddings_scale_by_sqrt_dim,
      logits_soft_cap=m.logits_soft_cap or None, scan_type=rg.ScanType.LINEAR_NATIVE)
  return rg.Griffin(cfg, param_dtype=jnp.float32, dtype=jnp.float32)


def batch_of(config, split, seed, start, count, length):
  ds = synthetic.rows(config, split=split, seed=seed, length=length, process_index=0,
                      process_count=1)
  rows = [ds[i] for i in range(start, start + count)]
  tokens = np.stack([r["tokens"] for r in rows])
  mask = np.stack([r["answer_mask"] for r in rows])
  return tokens[:, :-1], tokens[:, 1:], mask[:, 1:].astype(np.float32)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--task", choices=TASKS, required=True)
  parser.add_argument("--model", choices=sorted(MODELS), required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int)
  parser.add_argument("--time_limit", type=float, default=0.0)
  parser.add_argument("--eval_rows", type=int, default=256)
  parser.add_argument("--lengths", default="", help="evaluation lengths at the end, L1,L2,...")
  parser.add_argument("--tiny", action="store_true", help="a CPU check: short rows, few steps")
  args, rest = parser.parse_known_args(argv)
  overrides = []
  if args.tiny:
    overrides += ["--config.seq_len=32", "--config.data.synthetic.num_tokens_to_copy=4",
                  "--config.batch_size=4", "--config.total_steps=6", "--config.eval_every=3",
                  "--config.log_every=3", "--config.model.attention_window_size=16"]
  if args.steps:
    overrides.append(f"--config.total_steps={args.steps}")
  config = configlib.load(config_spec(args.task, args.model))
  configlib.override(config, overrides + rest)
  model = official_model(config)
  seq = config.seq_len
  lengths = [int(n) for n in args.lengths.split(",") if n] or [seq]

  def forward(p, inputs):
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return model.apply({"params": p}, inputs, positions, return_cache=False)[0]

  params = model.init(jax.random.PRNGKey(config.seed), jnp.zeros((1, seq), jnp.int32),
                      jnp.arange(seq)[None], return_cache=False)["params"]
  tx, _ = train.make_optimizer(config.optimizer, config.total_steps)
  opt_state = tx.init(params)

  def loss_fn(p, inputs, targets, mask):
    total, count = train.masked_cross_entropy(forward(p, inputs), targets, mask)
    return total / jnp.maximum(count, 1.0)

  @jax.jit
  def step(p, s, inputs, targets, mask):
    loss, grads = jax.value_and_grad(loss_fn)(p, inputs, targets, mask)
    updates, s = tx.update(grads, s, p)
    return jax.tree.map(jnp.add, p, updates), s, loss

  @jax.jit
  def correct(p, inputs, targets, mask):
    return jnp.sum((jnp.argmax(forward(p, inputs), -1) == targets) * mask), jnp.sum(mask)

  def accuracy(length):
    rows_per_batch = max(1, min(args.eval_rows, 64, 32 * 1024 // length))
    hits = total = 0.0
    for s0 in range(0, args.eval_rows, rows_per_batch):
      h, t = correct(params, *batch_of(config, 1, 1234, s0, rows_per_batch, length))
      hits, total = hits + float(h), total + float(t)
    return hits / total

  os.makedirs(args.out, exist_ok=True)
  bs, start = config.batch_size, time.time()
  with open(os.path.join(args.out, "metrics.jsonl"), "w") as log:
    i = 0
    for i in range(1, config.total_steps + 1):
      batch = batch_of(config, 0, config.seed, (i - 1) * bs, bs, seq)
      params, opt_state, loss = step(params, opt_state, *batch)
      if i % config.log_every == 0:
        log.write(json.dumps({"step": i, "loss": float(loss)}) + "\n")
      if i % config.eval_every == 0 or i == config.total_steps:
        acc = accuracy(seq)
        log.write(json.dumps({"step": i, "eval_accuracy": acc}) + "\n")
        log.flush()
        print(f"step {i}: loss {float(loss):.4f}, held-out accuracy {acc:.3f}", flush=True)
      if args.time_limit and time.time() - start > args.time_limit:
        print(f"time limit: stopped after step {i}", flush=True)
        break
    at_length = {n: accuracy(n) for n in lengths}
    log.write(json.dumps({"step": i, "accuracy_at_length": at_length}) + "\n")
    print(f"step {i}: " + ", ".join(f"L={n} {a:.3f}" for n, a in at_length.items()), flush=True)


if __name__ == "__main__":
  main()
