"""Continues a prompt with a trained or imported model, streaming the text as it is sampled.

  python scripts/sample.py --checkpoint DIR --prompt "def fibonacci(n):" \
      [--max_new_tokens=200] [--temperature=0] [--top_k=0] [--top_p=1] [--seed=0] \
      [--tokenizer=PATH] [--dtype=float32] [--memory_limit_gib=0]

(the defaults shown; temperature 0 is greedy, and top_k/top_p need a temperature > 0)

The tokenizer is the one the checkpoint was trained with (byte-level, or the SentencePiece file
recorded in it); ``--tokenizer`` overrides it (an imported official checkpoint needs
RecurrentGemma's ``tokenizer.model``). Sampling stops at the end-of-sequence token.

Before it reads a parameter, the prefill and decode loop is compiled and its memory compared
with the device's (or ``--memory_limit_gib``); one that does not fit exits 2 with one line
naming a ``--max_new_tokens`` that fits, found by compiling smaller ones. A line with the
check's time and memory goes to stderr.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def check_flags(args) -> None:
  """The sampling flags, checked before anything is read or compiled: one ConfigError line."""
  from recurrentgemma_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  if args.max_new_tokens <= 0:
    raise ConfigError(f"--max_new_tokens={args.max_new_tokens} must be > 0")
  if not 0 <= args.temperature < float("inf"):  # (NaN too)
    raise ConfigError(f"--temperature={args.temperature} must be >= 0 and finite (0: greedy)")
  if args.top_k < 0:
    raise ConfigError(f"--top_k={args.top_k} must be >= 0 (0: no top-k truncation)")
  if not 0 < args.top_p <= 1:
    raise ConfigError(f"--top_p={args.top_p} must be in (0, 1] (1: no nucleus truncation)")
  if args.temperature == 0 and (args.top_k or args.top_p != 1):
    given = " and ".join(f"--{name}" for name, unset in (("top_k", 0), ("top_p", 1.0))
                         if getattr(args, name) != unset)
    verb = "apply" if " and " in given else "applies"
    raise ConfigError(f"{given} {verb} only when sampling; --temperature=0 decodes greedily "
                      "(give --temperature > 0, e.g. 0.8)")
  if not args.memory_limit_gib >= 0:  # (NaN too)
    raise ConfigError(f"--memory_limit_gib={args.memory_limit_gib} must be >= 0")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--max_new_tokens", type=int, default=200)
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy (then --top_k and --top_p are refused)")
  parser.add_argument("--top_k", type=int, default=0,
                      help="sample among the k likeliest tokens (0, or the vocabulary's size or "
                      "more: all of them)")
  parser.add_argument("--top_p", type=float, default=1.0,
                      help="sample among the likeliest tokens whose probability reaches p, in "
                      "(0, 1] (1: all)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tokenizer", default=None, help="'byte' or a SentencePiece .model")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--memory_limit_gib", type=float, default=0.0,
                      help="memory per device to check the program against (0: the device's)")
  args = parser.parse_args(argv)
  cli.quiet_background_failures()  # (a damaged checkpoint: its one line, not Orbax's pages)

  with cli.user_errors():
    check_flags(args)  # (before jax is imported: a mistyped flag costs no start-up)
    import dataclasses  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    import ml_collections  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax import aot, data, sampling  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top

    device = jax.local_devices()[0]
    model = aot.checkpoint_model(args.checkpoint, device, dtype=args.dtype)
    name = args.tokenizer or model.meta.get("tokenizer")
    if not name:
      raise ConfigError(f"checkpoint {args.checkpoint!r} records no tokenizer; pass --tokenizer")
    tokenizer_config = data.default_config()
    tokenizer_config.tokenizer = name
    try:
      tokenizer = data.make_tokenizer(ml_collections.ConfigDict({"data": tokenizer_config}))
    except ConfigError as e:  # named as this command line names it
      given = "--tokenizer=" if args.tokenizer else "the checkpoint's tokenizer "
      raise ConfigError(str(e).replace("data.tokenizer=", given, 1)) from None
    if tokenizer.vocab_size > model.cfg.vocab_size:
      raise ConfigError(f"tokenizer {name!r} has {tokenizer.vocab_size} ids but the model only "
                        f"{model.cfg.vocab_size}")

    params = sampling.SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, stop_tokens=(tokenizer.eos_id,), seed=args.seed)
    prompt = [tokenizer.bos_id] + tokenizer.encode(args.prompt)
    # Text is printed once final: a character cut between tokens waits for its last byte.
    text = sampling.TextStream(tokenizer.decode, context=prompt)

    def stream(tokens, done):
      if done[0]:
        return
      piece = text.push(int(tokens[0]))
      if piece:
        sys.stdout.write(piece)
        sys.stdout.flush()

    # The fit check: the prefill and decode loop compiled for abstract parameters (nothing
    # read or allocated yet), its memory against the device's; the compiled program then runs.
    # Its line goes to stderr: stdout carries the text only.
    inputs = {}

    def lower(n: int):
      lowered, inputs[n] = sampling.lower_sample(
          model.graphdef, model.state, [prompt], dataclasses.replace(params, max_new_tokens=n),
          pad_id=tokenizer.pad_id, stream=stream)
      return lowered

    limit = aot.memory_limit(args.memory_limit_gib, device)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.state))
    started = time.perf_counter()
    what = f"sampling {args.max_new_tokens} tokens after a {len(prompt)}-token prompt"
    program = aot.check_program(what, lower, args.max_new_tokens, flag="--max_new_tokens",
                                limit=limit, hint=f"the parameters alone take "
                                f"{aot.human_bytes(weights)}; use a shorter --prompt or a "
                                "device with more memory")
    print(f"compiled {what} in {time.perf_counter() - started:.1f} s: "
          f"{aot.human_bytes(program.memory.total)} per device of "
          f"{aot.human_bytes(limit) if limit else 'an unknown amount'}", file=sys.stderr)
    state = model.restore()
    print(args.prompt, end="", flush=True)
    jax.block_until_ready(program.compiled(state, *inputs[args.max_new_tokens]))
    jax.effects_barrier()  # every token streamed
    print(text.flush())


if __name__ == "__main__":
  main()
