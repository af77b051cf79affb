"""Where an MQA Induction Heads model's final marker looks, by answer symbol (the record behind
docs/bench/synthetic_log.md, session 34; not part of the framework or its tests).

  JAX_PLATFORMS=cpu python docs/bench/ih_attention_probe.py RUN_DIR SEQ_LEN

RUN_DIR: an MQA run of ``scripts/synthetic.py`` (``DIR/induction_heads/mqa``) trained at SEQ_LEN.
For 512 held-out rows it recomputes each block's attention probabilities from the block's input
(its own projections and RoPE, causal), and prints, per layer, the mean weight of the last
query (the final marker) on the answer's position (one after the first marker) in the rows the
model gets right and wrong, and per answer symbol the accuracy, the positions (relative to
the first marker) its attention peaks at in layers 1 and 2, and how much the answer's own
position attends to the marker before it in each layer (the previous-token step).
"""

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from recurrentgemma_jax import attention, checkpoint, configlib, data  # pylint: disable=C0413
from recurrentgemma_jax.data import synthetic as tasks  # pylint: disable=wrong-import-position


def main(run_dir, seq_len):
  net, _ = checkpoint.load_model(run_dir)
  config = configlib.load("configs/synthetic.py:induction_heads")
  config.seq_len = config.data.synthetic.eval_seq_len = seq_len
  config.batch_size, config.data.eval_tokens = 32, 512 * seq_len
  weight, peak, right, symbol, back = [], [], [], [], []
  for batch in data.make_eval_batches(config):
    tokens, pos = jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_pos"])
    answer_at = np.argmax(batch["inputs"] == tasks.MARKER, axis=1) + 1
    x, w, p, bk = net.embedder.encode(tokens), [], [], []
    for block in net.blocks:
      _, normed = block.temporal_pre_norm.with_skip(x)
      a = block.attention_block
      b, t, _ = normed.shape
      q = attention.apply_rope(a.proj_q(normed).reshape(b, t, a.num_heads, a.head_dim), pos)
      k = attention.apply_rope(a.proj_k(normed).reshape(b, t, 1, a.head_dim), pos)[:, :, 0]
      logits = jnp.einsum("btnh,bsh->bnts", q, k) * a.head_dim**-0.5
      logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
      head0 = np.asarray(jax.nn.softmax(logits, axis=-1)[:, 0])  # [b, query, key]
      probs = head0[:, -1]  # the last query
      w.append(probs[np.arange(b), answer_at])
      # The answer's position's weight on the marker before it (the previous-token step).
      bk.append(head0[np.arange(b), answer_at, answer_at - 1])
      p.append(probs.argmax(-1) - answer_at + 1)  # peak, relative to the first marker
      x = block(x, pos)[0]
    predicted = np.asarray(jnp.argmax(net(tokens, pos)[:, -1], axis=-1))
    weight.append(np.stack(w, 1))
    peak.append(np.stack(p, 1))
    back.append(np.stack(bk, 1))
    right.append(predicted == batch["targets"][:, -1])
    symbol.append(batch["targets"][:, -1] - tasks.FIRST_SYMBOL)
  weight, peak, right, symbol, back = map(np.concatenate, (weight, peak, right, symbol, back))
  np.set_printoptions(precision=2, suppress=True)
  print("mean weight of the last query on the answer's position, by layer")
  print(f"  right rows ({right.sum()}): {weight[right].mean(0)}")
  print(f"  wrong rows ({(~right).sum()}): {weight[~right].mean(0) if (~right).any() else '-'}")
  for s in range(config.data.synthetic.vocab_size):
    rows = symbol == s
    if rows.any():
      top = [collections.Counter(peak[rows, layer].tolist()).most_common(3) for layer in (1, 2)]
      print(f"  s{s}: {rows.sum()} rows, accuracy {right[rows].mean():.2f}, weight on the "
            f"answer {weight[rows].mean(0)}, peaks (offset: rows) layer 1 {top[0]}, "
            f"layer 2 {top[1]}; the answer's position on the marker before it, by layer: "
            f"{back[rows].mean(0)}")


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
