"""Fine-tuning RecurrentGemma 2B or 9B from an imported official checkpoint.

  python scripts/import_recurrentgemma.py --src /ckpts/2b --dst /ckpts/2b-imported
  python scripts/train.py --config configs/recurrentgemma.py:2b --workdir runs/ft \
      --config.init_from=/ckpts/2b-imported --config.data.tokenizer=/ckpts/tokenizer.model \
      --config.data.source=jsonl --config.data.paths='/data/*.jsonl'
"""

from recurrentgemma_jax import configlib, presets


def get_config(arg=None):
  size = arg or "2b"
  c = configlib.base_config()
  c.model.update(presets.preset("recurrentgemma", size))
  c.model.vocab_size = 256_000
  c.model.dtype = "bfloat16"
  c.model.remat = "block"
  c.init_from = ""  # set to the imported checkpoint
  c.total_steps = 1000
  c.batch_size = 16
  c.seq_len = 2048
  c.data.eval_tokens = 262_144  # 128 held-out rows of 2048 tokens
  c.log_every = 10
  c.eval_every = 200
  c.checkpoint_every = 200
  c.optimizer.learning_rate = 1e-5
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.0
  c.optimizer.schedule = "constant"
  return c
