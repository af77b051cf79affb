"""The default run: a small Griffin (R, R, local attention) on the built-in corpus (Python's
standard library source), byte-level tokens. Trains on 2 CPU cores in a few minutes.

  python scripts/train.py            # same as --config configs/default.py
"""

from recurrentgemma_jax import configlib


def get_config(arg=None):
  if arg:  # (a size belongs to configs/griffin.py, hawk.py, mqa.py or gla.py)
    raise ValueError(f"configs/default.py takes no argument, got {arg!r}; for a model size use "
                     f"e.g. configs/griffin.py:{arg}")
  c = configlib.base_config()
  c.total_steps = 400
  c.batch_size = 16
  c.seq_len = 256
  c.log_every = 20
  c.eval_every = 200
  c.checkpoint_every = 200
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 50
  c.model.family = "griffin"
  c.model.width = 128
  c.model.lru_width = 128
  c.model.num_layers = 3
  c.model.num_heads = 2
  c.model.num_gate_blocks = 2
  c.model.mlp_expanded_width = 384
  c.model.attention_window_size = 128
  c.model.dtype = "float32"   # bfloat16 is slow on CPUs; accelerators use bfloat16
  c.data.source = "builtin"
  c.data.tokenizer = "byte"
  return c
