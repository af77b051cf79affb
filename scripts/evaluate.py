"""Per-token negative log-likelihood of token sequences under a checkpoint.

  python scripts/evaluate.py --checkpoint DIR --tokens IN.npy --nll_out OUT.npy [--dtype float32] \
      [--batch_size=8] [--memory_limit_gib=0]

``IN.npy``: int32 ``[N, T]`` token ids, one sequence per row, in the checkpoint's tokenizer's ids
(the byte tokenizer's id of byte ``b`` is ``b + 3``, after pad 0, bos 1, eos 2; start a row with
bos as training does; every position is scored, padding included). ``OUT.npy``: float32 ``[N, T-1]``,
the NLL (nats) of ``tokens[:, t+1]`` given ``tokens[:, :t+1]``. Prints the mean NLL and the
perplexity. ``DIR`` is an imported checkpoint or a training workdir (its latest readable step).

Before it reads a parameter, the forward pass over ``--batch_size`` rows is compiled and its
memory compared with the device's (or ``--memory_limit_gib``); one that does not fit exits 2
with one line naming a batch size that fits, found by compiling smaller ones.

Long-context mode (the Griffin paper's Fig. 5): ``--curve_out CURVE.csv`` writes, for every
position ``t``, the mean NLL over rows and over positions ``<= t`` ("mean so far"), and
``--plot CURVE.png`` draws it against the position (log scale), with ``--train_len`` marked.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recurrentgemma_jax import cli  # pylint: disable=g-import-not-at-top


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--tokens", required=True, help="int32 [N, T] .npy file")
  parser.add_argument("--nll_out", required=True, help="float32 [N, T-1] .npy output")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="activation dtype of the forward pass")
  parser.add_argument("--batch_size", type=int, default=8, help="rows per forward pass")
  parser.add_argument("--memory_limit_gib", type=float, default=0.0,
                      help="memory per device to check the program against (0: the device's)")
  parser.add_argument("--curve_out", default=None, help="CSV of mean-so-far NLL by position")
  parser.add_argument("--plot", default=None, help="PNG of the mean-so-far NLL curve")
  parser.add_argument("--train_len", type=int, default=0,
                      help="training sequence length, marked on the plot (0: none)")
  args = parser.parse_args(argv)
  cli.quiet_background_failures()  # (a damaged checkpoint: its one line, not Orbax's pages)

  with cli.user_errors():
    import time  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax import aot, evaluation  # pylint: disable=g-import-not-at-top
    from recurrentgemma_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top

    tokens = evaluation.read_tokens(args.tokens)
    if args.batch_size <= 0:
      raise ConfigError(f"--batch_size={args.batch_size} must be positive")
    if not args.memory_limit_gib >= 0:  # (NaN too)
      raise ConfigError(f"--memory_limit_gib={args.memory_limit_gib} must be >= 0")
    if args.train_len < 0:
      raise ConfigError(f"--train_len={args.train_len} must be >= 0 (0: none)")
    if args.train_len and not args.plot:
      raise ConfigError(f"--train_len={args.train_len} only marks the --plot; add --plot "
                        "CURVE.png or leave --train_len out")
    if not args.nll_out.endswith(".npy"):  # (np.save would write NLL_OUT.npy)
      raise ConfigError(f"--nll_out {args.nll_out!r} must end in .npy")
    device = jax.local_devices()[0]
    model = aot.checkpoint_model(args.checkpoint, device, dtype=args.dtype)
    if tokens.max() >= model.cfg.vocab_size:
      raise ConfigError(f"--tokens {args.tokens!r} has token id {int(tokens.max())} but the "
                        f"model's vocabulary has {model.cfg.vocab_size} ids")
    # The fit check: the forward pass compiled for abstract parameters (nothing read or
    # allocated yet), its memory against the device's; the compiled program then runs.
    rows, length = min(args.batch_size, len(tokens)), tokens.shape[1]
    limit = aot.memory_limit(args.memory_limit_gib, device)
    started = time.perf_counter()
    program = aot.check_program(
        f"the forward pass over {rows} rows of {length} tokens",
        lambda n: evaluation.lower_nll(model.graphdef, model.state, n, length, model.sharding),
        rows, flag="--batch_size", limit=limit, log=print,
        hint=f"rows of {length} tokens need a device with more memory")
    print(f"compiled the forward pass over {rows} rows of {length} tokens in "
          f"{time.perf_counter() - started:.1f} s: {aot.human_bytes(program.memory.total)} "
          f"per device of {aot.human_bytes(limit) if limit else 'an unknown amount'}")
    params = model.restore()
    nll = evaluation.nll_in_batches(lambda batch: program.compiled(params, batch), tokens, rows)
    for out in (args.nll_out, args.curve_out, args.plot):  # (their folders made as needed)
      if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.save(args.nll_out, nll)
    mean = float(nll.mean())
    print(f"mean NLL {mean:.6f} nats/token, perplexity {np.exp(mean):.4f} "
          f"over {nll.size} tokens -> {args.nll_out}")
    if args.curve_out or args.plot:
      curve = evaluation.mean_so_far(nll)
      if args.curve_out:
        evaluation.write_curve(args.curve_out, curve)
      if args.plot:
        evaluation.plot_curve(args.plot, curve, train_len=args.train_len,
                              label=os.path.basename(os.path.normpath(args.checkpoint)))
      print(f"mean-so-far NLL at position {len(curve)}: {curve[-1]:.4f}")


if __name__ == "__main__":
  main()
