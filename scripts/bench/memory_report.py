"""Bytes per device of parameters, gradients and optimizer state at each ZeRO stage, from XLA's
compiled memory analysis (nothing is allocated: every function is compiled on abstract inputs).

  python scripts/bench/memory_report.py --presets griffin:7b,griffin:14b --devices 8 --model_axis 1

Runs on simulated CPU devices (it sets XLA_FLAGS itself when --devices > 1 on a CPU). For each
preset and ZeRO stage it compiles, on a (data = devices / model_axis, model = model_axis) mesh:
parameter init (output = the parameters as they are stored), the gradient of the loss on one
short batch (output = the gradients, sharded like the parameters; the train step leaves
their layout to XLA), and the optimizer init (output = the AdamW moments).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default="griffin:7b,griffin:14b")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--model_axis", type=int, default=1)
  parser.add_argument("--zero", default="0,1,3")
  args = parser.parse_args(argv)
  if args.devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import configlib, train  # pylint: disable=g-import-not-at-top

  print(f"{args.devices} devices, mesh data={args.devices // args.model_axis} "
        f"model={args.model_axis}; GiB per device (compiled memory analysis)\n")
  print("| preset | params | ZeRO | parameters | gradients | optimizer state | total |")
  print("|---|---|---|---|---|---|---|")
  gib = 2.0**30
  for item in args.presets.split(","):
    family, size = item.split(":")
    for zero in (int(z) for z in args.zero.split(",")):
      config = configlib.family_config(family, size)
      config.model.vocab_size = 256_000
      config.model.param_dtype = "float32"
      config.update(zero=zero, batch_size=args.devices // args.model_axis, seq_len=64)
      config.mesh.data, config.mesh.model = args.devices // args.model_axis, args.model_axis
      plan = train.setup(config, jax.devices()[:args.devices])
      params_sh = plan.state_shardings["params"]
      n_params = sum(x.size for x in jax.tree.leaves(plan.params_abstract))

      def init_params():
        from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
        return nnx.state(model_lib.init_model(plan.model_cfg, 0))

      params_bytes = jax.jit(init_params, out_shardings=params_sh).lower().compile(
      ).memory_analysis().output_size_in_bytes
      opt_bytes = jax.jit(plan.tx.init, out_shardings=plan.state_shardings["opt_state"]).lower(
          plan.params_abstract).compile().memory_analysis().output_size_in_bytes
      batch = {k: jax.ShapeDtypeStruct((config.batch_size, config.seq_len),
                                       jnp.float32 if k == "loss_mask" else jnp.int32,
                                       sharding=plan.batch_sharding)
               for k in ("inputs", "targets", "segment_pos", "loss_mask")}
      params_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                               plan.params_abstract, params_sh)

      def grads(params, batch):
        def loss(p):
          logits = nnx.merge(plan.graphdef, p)(batch["inputs"], batch["segment_pos"])
          return train.masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])[0]
        return jax.grad(loss)(params)

      grad_bytes = jax.jit(grads, out_shardings=params_sh).lower(params_in, batch).compile(
      ).memory_analysis().output_size_in_bytes
      total = params_bytes + grad_bytes + opt_bytes
      print(f"| {family} {size} | {n_params / 1e9:.2f}B | {zero} | {params_bytes / gib:.2f} | "
            f"{grad_bytes / gib:.2f} | {opt_bytes / gib:.2f} | {total / gib:.2f} |", flush=True)


if __name__ == "__main__":
  main()
