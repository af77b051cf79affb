"""Per-token log-likelihood of whole sequences (one document per row)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recurrentgemma_jax.errors import ConfigError


def read_tokens(path: str) -> np.ndarray:
  """An int ``[N, T]`` array with ``N >= 1``, ``T >= 2`` from a ``.npy`` file, or a one-line
  error."""
  if not os.path.isfile(path):
    raise ConfigError(f"--tokens {path!r} does not exist")
  try:
    tokens = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ConfigError(f"--tokens {path!r} is not a .npy array: {e}") from None
  if not isinstance(tokens, np.ndarray):  # an .npz archive loads as a mapping of arrays
    raise ConfigError(f"--tokens {path!r} is an .npz archive; save one array with np.save "
                      "(a .npy file)")
  if (tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2
      or not np.issubdtype(tokens.dtype, np.integer)):
    raise ConfigError(f"--tokens {path!r} has shape {tokens.shape} and dtype {tokens.dtype}; "
                      "expected integers of shape [N, T] with N >= 1 and T >= 2")
  if tokens.size and tokens.min() < 0:
    raise ConfigError(f"--tokens {path!r} has negative token ids")
  return tokens.astype(np.int32)


@functools.partial(jax.jit, static_argnames="graphdef")
def _row_nll(graphdef, state, tokens):
  model = nnx.merge(graphdef, state)
  segment_pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits = model(tokens, segment_pos)[:, :-1]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def lower_nll(graphdef, state, rows: int, length: int, sharding=None):
  """The per-token NLL of ``rows`` sequences of ``length`` tokens, lowered for the model
  ``nnx.split`` into ``graphdef, state`` (``state`` may hold ShapeDtypeStructs: nothing is
  allocated); its compiled form takes ``(state, tokens [rows, length])``."""
  tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=sharding)
  return _row_nll.lower(graphdef, state, tokens)


def nll_in_batches(step, tokens: np.ndarray, rows: int) -> np.ndarray:
  """``[N, T-1]`` float32 from ``step(tokens [rows, T]) -> nll [rows, T-1]`` run over
  ``tokens`` ``rows`` at a time (the last batch padded: one compiled shape for all)."""
  out = []
  for start in range(0, len(tokens), rows):
    batch = tokens[start:start + rows]
    pad = rows - len(batch)
    if pad:
      batch = np.concatenate([batch, np.zeros((pad, batch.shape[1]), batch.dtype)])
    out.append(np.asarray(step(batch))[:rows - pad])
  return np.concatenate(out).astype(np.float32)


def token_nll(model, tokens: np.ndarray, *, batch_size: int = 8) -> np.ndarray:
  """``[N, T-1]`` float32: NLL of ``tokens[:, t+1]`` given ``tokens[:, :t+1]``, computed
  ``batch_size`` rows (at most ``N``) at a time."""
  graphdef, state = nnx.split(model)
  return nll_in_batches(lambda batch: _row_nll(graphdef, state, jnp.asarray(batch)), tokens,
                        min(batch_size, len(tokens)))


def mean_so_far(nll: np.ndarray) -> np.ndarray:
  """``[T-1]``: at position ``t``, the mean NLL over all rows and positions ``<= t``."""
  per_position = nll.astype(np.float64).mean(axis=0)
  return (np.cumsum(per_position) / np.arange(1, len(per_position) + 1)).astype(np.float32)


def write_curve(path: str, curve: np.ndarray) -> None:
  with open(path, "w") as f:
    f.write("position,mean_nll_so_far\n")
    for t, value in enumerate(curve, start=1):
      f.write(f"{t},{value:.6f}\n")


def plot_curve(path: str, curve: np.ndarray, *, train_len: int = 0, label: str = "") -> None:
  """Mean-so-far NLL against the token position (log x), as in the Griffin paper's Fig. 5."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(np.arange(1, len(curve) + 1), curve, label=label or None)
  if train_len:
    ax.axvline(train_len, color="gray", linestyle="--", label=f"training length {train_len}")
  ax.set_xscale("log")
  ax.set_xlabel("token position")
  ax.set_ylabel("mean NLL so far (nats)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


@functools.lru_cache(maxsize=8)
def _jit_eval_step(graphdef):
  """The jitted evaluation step of one model structure, shared by every model of that
  structure (e.g. a run's checkpoints), so that each batch shape compiles once."""
  from recurrentgemma_jax import train  # pylint: disable=g-import-not-at-top
  return jax.jit(train.make_eval_step(graphdef))


def masked_accuracy(model, batches) -> float:
  """Fraction of the ``loss_mask`` tokens whose argmax prediction is the target, over model
  batches (``inputs``, ``targets``, ``segment_pos``, ``loss_mask``; e.g. a synthetic task's
  answers): the training job's evaluation step, on a model."""
  graphdef, params = nnx.split(model)
  eval_step = _jit_eval_step(graphdef)
  fields = ("inputs", "targets", "segment_pos", "loss_mask")
  sums = [eval_step(params, {k: jnp.asarray(batch[k]) for k in fields}) for batch in batches]
  _, count, hits = np.sum(jax.device_get(sums), axis=0)
  return float(hits) / max(float(count), 1.0)
