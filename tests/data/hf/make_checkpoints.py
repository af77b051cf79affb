"""Makes the small transformers RecurrentGemma checkpoints that tests/test_hf.py imports.

Run once, with torch and transformers, outside the project's environment (the tests need
neither):

  python3 -m venv /tmp/hfenv
  /tmp/hfenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  /tmp/hfenv/bin/pip install transformers==5.18.0 safetensors numpy sentencepiece
  /tmp/hfenv/bin/python tests/data/hf/make_checkpoints.py

(made with torch 2.13.0+cpu and transformers 5.18.0). For each model it writes, under
``tests/data/hf/NAME/``, what ``save_pretrained`` writes (``config.json``, safetensors, an
index when sharded), and ``tokens.npy`` (int32 ``[N, T]``) with ``logits.npy`` (float32
``[N, T, V]``): transformers' logits for those tokens, computed in float32 from the weights as
stored (``from_pretrained`` of the saved directory). Every weight is moved away from its
initial value, so norm scales and biases that start at zero are checked too.

- ``griffin``: recurrent, recurrent, attention, recurrent; ``lru_width`` 48 != width 32; 4
  query heads, one key/value head; window 5 (transformers' meaning: 5 keys) on rows of 17;
  float32 in one file; a small SentencePiece ``tokenizer.model`` beside it.
- ``attention_first``: attention, recurrent, attention; 2 query heads, one key/value head;
  ``lru_width`` 64; Conv1D width 3; window 3; soft-cap 20; stored in bfloat16, sharded.
"""

import os
import shutil
import tempfile

import numpy as np
import sentencepiece as spm
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, LENGTH = 3, 17

MODELS = {
    "griffin": dict(
        config=dict(vocab_size=96, hidden_size=32, intermediate_size=2 * 40,
                    num_attention_heads=4, num_key_value_heads=1, lru_width=48,
                    num_hidden_layers=4, block_types=["recurrent", "recurrent", "attention"],
                    attention_window_size=5, conv1d_width=4, logits_soft_cap=30.0),
        dtype=torch.float32, max_shard_size="50GB", tokenizer=True, seed=0),
    "attention_first": dict(
        config=dict(vocab_size=96, hidden_size=32, intermediate_size=2 * 48,
                    num_attention_heads=2, num_key_value_heads=1, lru_width=64,
                    num_hidden_layers=3, block_types=["attention", "recurrent"],
                    attention_window_size=3, conv1d_width=3, logits_soft_cap=20.0),
        dtype=torch.bfloat16, max_shard_size="24KB", tokenizer=False, seed=1),
}


def make_tokenizer(path: str, vocab_size: int) -> None:
  """A tiny SentencePiece model (identity normalisation keeps the file small)."""
  with tempfile.TemporaryDirectory() as tmp:
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
      for i in range(200):
        f.write(f"the griffin and the hawk fly over hill {i % 7} and river {i % 5}\n")
    spm.SentencePieceTrainer.train(
        input=text, model_prefix=os.path.join(tmp, "sp"), vocab_size=vocab_size,
        model_type="bpe", normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, minloglevel=2)
    shutil.copy(os.path.join(tmp, "sp.model"), path)


def make(name: str, spec: dict) -> None:
  out = os.path.join(HERE, name)
  shutil.rmtree(out, ignore_errors=True)
  torch.manual_seed(spec["seed"])
  config = transformers.RecurrentGemmaConfig(**spec["config"])
  model = transformers.RecurrentGemmaForCausalLM(config).eval()
  with torch.no_grad():
    for param in model.parameters():  # (tied: the embedding is perturbed once)
      param.add_(0.2 * torch.randn_like(param))
  model.to(spec["dtype"]).save_pretrained(out, max_shard_size=spec["max_shard_size"])
  if spec["tokenizer"]:
    make_tokenizer(os.path.join(out, "tokenizer.model"), 64)

  loaded = transformers.RecurrentGemmaForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager").eval()
  rng = np.random.default_rng(spec["seed"])
  tokens = rng.integers(0, config.vocab_size, size=(ROWS, LENGTH)).astype(np.int32)
  with torch.no_grad():
    logits = loaded(torch.from_numpy(tokens).long(), use_cache=False).logits
  np.save(os.path.join(out, "tokens.npy"), tokens)
  np.save(os.path.join(out, "logits.npy"), logits.float().numpy())
  print(name, sorted(os.listdir(out)))


if __name__ == "__main__":
  print("torch", torch.__version__, "transformers", transformers.__version__)
  for model_name, model_spec in MODELS.items():
    make(model_name, model_spec)
