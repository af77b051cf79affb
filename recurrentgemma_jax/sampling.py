"""Sampling: prefill the prompts in parallel, then decode one token at a time through the
fixed-size caches (``Model.extend``), the whole loop compiled once (``lax.scan``, no host sync
per token; streaming goes through an ordered host callback).

Prompts of different lengths are left-padded; the padding is a document of its own
(``segment_pos`` restarts at 0 at each prompt's first token), so no state, conv tap or
attention key crosses from the padding into a prompt.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pallas_kernels import dispatch

# XLA's dot merger joins matmuls that share an input (a recurrent block's ``linear_x`` and
# ``linear_y``) into one, and in the decoding loop it concatenated their weights again at every
# step (0.33 ms of Hawk 1.3B's 15.6 ms at 2048 rows). Off, that step took 15.04-15.08 against
# 15.27 ms, Griffin's 18.09-18.11 against 18.17-18.18 (H100, docs/bench/decode_log.md, session 28).
GPU_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_new_tokens: int = 64
  temperature: float = 0.0      # 0: greedy
  top_k: int = 0                # 0: no top-k truncation
  top_p: float = 1.0            # 1: no nucleus truncation
  stop_tokens: tuple[int, ...] = ()
  seed: int = 0


@dataclasses.dataclass
class SampleOutput:
  tokens: np.ndarray        # int32 [B, max_new_tokens]; pad_id after a stop token
  lengths: np.ndarray       # int32 [B]: generated tokens up to and including a stop token
  logits: np.ndarray | None  # float32 [B, max_new_tokens, V]: the logits each token came from


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
  """``tokens, segment_pos`` int32 ``[B, P]`` and prompt ``lengths`` ``[B]``."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token (e.g. the BOS token)")
  width = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  segment_pos = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    pad = width - len(prompt)
    tokens[row, pad:] = prompt
    segment_pos[row, :pad] = np.arange(pad)
    segment_pos[row, pad:] = np.arange(len(prompt))
  return tokens, segment_pos, np.asarray([len(p) for p in prompts], np.int32)


def choose(logits, key, temperature: float, top_k: int, top_p: float):
  """One token per row from ``logits`` ``[B, V]``."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32)
  # (the largest logit 0 first: a tiny temperature gives -inf, never inf, and stays greedy)
  logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
  if top_k and top_k < logits.shape[-1]:  # (the whole vocabulary or more: no truncation)
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # smallest set whose probability reaches top_p: keep a token if the mass before it < top_p
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class TextStream:
  """The text of sampled tokens, piece by piece as it becomes final: :meth:`push` takes one
  token and returns the text it completes (often ""), :meth:`flush` what is left at the end.

  A character can be cut between tokens (UTF-8 bytes of the byte tokenizer, SentencePiece's
  byte-fallback pieces), and decoding the cut part gives U+FFFD: text that ends in U+FFFD is
  held back until more tokens arrive, up to ``MAX_HELD`` tokens (a UTF-8 character has at most
  4 bytes, so a longer run is a U+FFFD the model really produced). Only the tokens since the
  last piece are decoded, after the piece before them (the context a SentencePiece decoder
  needs for a word's leading space), so each token costs the same however long the output;
  ``context`` (the prompt's ids) gives the first piece its context."""

  MAX_HELD = 4
  CONTEXT = 4  # the prompt's last tokens decoded before the first piece

  def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
    self._decode = decode
    self._ids = [int(i) for i in context][-self.CONTEXT:]
    self._start = 0                # the window decoded: ids[start:]
    self._read = len(self._ids)    # ids[start:read] are the context, already printed

  def push(self, token: int) -> str:
    self._ids.append(int(token))
    text = self._decode(self._ids[self._start:])
    if text.endswith("\ufffd") and len(self._ids) - self._read < self.MAX_HELD:
      return ""  # maybe a character whose last bytes are still to come
    return self._advance(text)

  def flush(self) -> str:
    """The text held back (a character cut at the end shows as U+FFFD)."""
    if self._read == len(self._ids):
      return ""
    return self._advance(self._decode(self._ids[self._start:]))

  def _advance(self, text: str) -> str:
    printed = self._decode(self._ids[self._start:self._read])
    self._start, self._read = self._read, len(self._ids)
    return text[len(printed):]


def compiler_options(platform: str | None = None) -> dict:
  """The XLA options the sampling programs are compiled with on ``platform`` (default: where the
  current program runs, ``dispatch.target_platform``)."""
  return dict(GPU_COMPILER_OPTIONS) if (platform or dispatch.target_platform()) == "gpu" else {}


def _generate(graphdef, state, tokens, segment_pos, lengths, *, params: SamplingParams,
              pad_id: int, return_logits: bool, stream: Callable | None):
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(tokens.shape[0], tokens.shape[1] + params.max_new_tokens)
  logits, cache = model.extend(tokens, segment_pos, cache)
  new_tokens, done, step_logits = decode(model, cache, logits[:, -1], lengths, params,
                                         pad_id=pad_id, return_logits=return_logits,
                                         stream=stream)
  return new_tokens.T, done.T, None if step_logits is None else step_logits.swapaxes(0, 1)


@functools.cache
def _jitted_generate(platform: str):
  return jax.jit(_generate, static_argnames=("graphdef", "params", "pad_id", "return_logits",
                                             "stream"),
                 compiler_options=compiler_options(platform) or None)


def weights_in_compute_dtype(model):
  """``model`` with its float32 weight matrices (every parameter of two or more dimensions) cast
  to the compute dtype ``model.cfg.dtype``, once. The layers cast each of them to that dtype
  where they use it, so results do not change; inside the decoding loop XLA redid the cast of
  the embedding table at every step (an H100 profile of Hawk 1.3B at 2048 rows: 1.05 ms of a
  16.5 ms step). Vectors (norm scales, biases, the RG-LRU's ``a_param``) stay float32. The
  copy lives for the whole loop: with float32 weights and bfloat16 compute it adds half the
  weights' size to the program's memory, which ``sample.py``'s fit check counts."""
  dtype = jnp.dtype(model.cfg.dtype)
  if dtype == jnp.float32:
    return model
  graphdef, state = nnx.split(model)
  state = jax.tree.map(
      lambda p: p.astype(dtype) if p.ndim >= 2 and p.dtype == jnp.float32 else p, state)
  return nnx.merge(graphdef, state)


def decode(model, cache, logits, positions, params: SamplingParams, *, pad_id: int = 0,
           return_logits: bool = False, stream: Callable | None = None,
           return_cache: bool = False):
  """The decoding loop (one ``lax.scan``, traced inside a jit): ``params.max_new_tokens`` tokens
  per row, the first chosen from ``logits`` (``[B, V]``, the prompt's last), each fed through
  ``model.extend`` at the row's next position (``positions``, ``[B]``) with ``cache`` and the
  next chosen from its logits in the same step. Returns ``(tokens, done, logits)``, time first
  (``[N, B]``; the logits each token came from ``[N, B, V]``, or None), and with
  ``return_cache`` the cache after the last step as a fourth item (a caller that donates
  ``cache`` to its jit then updates it in place: otherwise XLA copies every cache buffer into
  the loop, 27 GB for MQA 1.3B at 1024 rows). The loop carries the
  chosen token, not the ``[B, V]`` logits (float32: at 2048 rows and a 256K vocabulary, 2 GB
  written and read again at every step), and reads the weights in the compute dtype
  (``weights_in_compute_dtype``). Greedy decoding without ``return_logits`` takes each token
  from ``model.greedy_extend``, which on GPUs, from ``greedy.MIN_ROWS`` rows a device, does not
  write the logits at all."""
  stops = jnp.asarray(params.stop_tokens or (-1,), jnp.int32)
  model = weights_in_compute_dtype(model)

  def pick(logits, key, done):
    return jnp.where(done, pad_id, choose(logits, key, params.temperature, params.top_k,
                                         params.top_p))

  greedy = params.temperature == 0.0 and not return_logits

  def step(carry, key):
    cache, token, pos, done, token_logits = carry
    if stream is not None:
      jax.debug.callback(stream, token, done, ordered=True)
    done = done | jnp.isin(token, stops)
    out = (token, done, token_logits)
    if greedy:  # the model's greedy path: a GPU never writes the logits (Model.greedy_extend)
      token, cache = model.greedy_extend(token[:, None], pos[:, None], cache)
      return (cache, jnp.where(done, pad_id, token), pos + 1, done, None), out
    logits, cache = model.extend(token[:, None], pos[:, None], cache)
    logits = logits[:, 0]
    return (cache, pick(logits, key, done), pos + 1, done,
            logits if return_logits else None), out

  # token t is chosen with keys[t]; the last step's choice is not used
  keys = jax.random.split(jax.random.PRNGKey(params.seed), params.max_new_tokens)
  not_done = jnp.zeros((logits.shape[0],), bool)
  init = (cache, pick(logits, keys[0], not_done), positions, not_done,
          logits if return_logits else None)
  carry, outputs = jax.lax.scan(step, init, jnp.roll(keys, -1, axis=0))
  return (*outputs, carry[0]) if return_cache else outputs


def lower_sample(graphdef, state, prompts: Sequence[Sequence[int]],
                 params: SamplingParams = SamplingParams(), *, pad_id: int = 0,
                 return_logits: bool = False, stream: Callable | None = None):
  """``(lowered, inputs)``: ``sample``'s prefill and decode loop for these prompts, lowered for
  the model ``nnx.split`` into ``graphdef, state`` (``state`` may hold ShapeDtypeStructs:
  nothing is allocated), and the token arrays its compiled form takes after the state:
  ``compiled(state, *inputs)`` returns ``(new_tokens, done, logits)`` (see :func:`output`)."""
  inputs = left_pad(prompts, pad_id)
  generate = _jitted_generate(dispatch.target_platform())
  lowered = generate.lower(graphdef, state, *inputs, params=params, pad_id=pad_id,
                           return_logits=return_logits, stream=stream)
  return lowered, inputs


def compiled_sampler(model, prompts: Sequence[Sequence[int]],
                     params: SamplingParams = SamplingParams(), *, pad_id: int = 0):
  """``(run, args)``: ``sample``'s prefill and decode loop for these prompts, compiled ahead of
  time; ``run(*args)`` returns ``(new_tokens, done, None)`` as device arrays. For timing decoding
  without compilation (``scripts/bench/bench_decode.py``)."""
  graphdef, state = nnx.split(model)
  lowered, inputs = lower_sample(graphdef, state, prompts, params, pad_id=pad_id)
  return lowered.compile(), (state, *inputs)


def output(new_tokens, done, logits, params: SamplingParams) -> SampleOutput:
  """The SampleOutput of ``_generate``'s results (device arrays)."""
  done = np.asarray(done)
  # a row's length: up to and including its first stop token
  generated = np.where(done.any(axis=1), done.argmax(axis=1) + 1, params.max_new_tokens)
  return SampleOutput(np.asarray(new_tokens), generated.astype(np.int32),
                      None if logits is None else np.asarray(logits))


def sample(model, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(),
           *, pad_id: int = 0, return_logits: bool = False,
           stream: Callable[[np.ndarray, np.ndarray], None] | None = None) -> SampleOutput:
  """Continues each prompt (token ids) by up to ``params.max_new_tokens`` tokens.

  ``stream(tokens [B], finished [B])`` is called on the host after each decoding step.
  """
  tokens, segment_pos, lengths = left_pad(prompts, pad_id)
  graphdef, state = nnx.split(model)
  generate = _jitted_generate(dispatch.target_platform())
  return output(*generate(graphdef, state, tokens, segment_pos, lengths, params=params,
                          pad_id=pad_id, return_logits=return_logits, stream=stream), params)
