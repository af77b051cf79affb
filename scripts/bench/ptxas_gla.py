"""Registers, spills and shared memory of gla.gpu's Triton kernels, without a GPU.

    pip install --target /tmp/tri --no-deps triton==3.9.0      # once (about 290 MB)
    TRITON_DEFAULT_FP_FUSION=1 python scripts/bench/ptxas_gla.py --triton /tmp/tri \
        [--dh 64 128] [--variants fact fact-w8 fact-c32 ...]

Lowers forward + backward of gla.gpu at (1, 4 chunks, 2, Dh, Dh) in bfloat16 for each
bench_gla variant (set_variant: options and chunk size), captures each pallas_call's Triton IR
with its warps and stages, compiles it to PTX for sm_90 with the pip Triton and runs its
bundled ptxas -v for sm_90a. The pip Triton is not the one inside jaxlib that compiles the
kernels on the GPU machine, so the numbers are indicative (ptxas's register count at 255 with
spills is where the kernels got slower); a failure here is still worth a look before spending
GPU time. On an H100 a block has at most 227 KiB of shared memory and a thread 255 registers.
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top,wrong-import-position

import bench_gla  # pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels.gla import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position


def triton_kernels(fn, args):
  """[(Triton IR text, backend config)] of every pallas_call in fn(*args), lowered for CUDA."""
  irs, configs = [], []
  lower = registration.lowering.lower_jaxpr_to_triton_module
  custom_call = registration.mlir.custom_call

  def capture_ir(*a, **kw):
    result = lower(*a, **kw)
    irs.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  def capture_config(*a, backend_config=None, **kw):
    configs.append({k: str(backend_config[k]) for k in ("name", "num_warps", "num_stages")})
    return custom_call(*a, backend_config=backend_config, **kw)

  registration.lowering.lower_jaxpr_to_triton_module = capture_ir
  registration.mlir.custom_call = capture_config
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
    registration.mlir.custom_call = custom_call
  return list(zip(irs, configs))


def fwd_bwd_args(dh, c):
  """As bench_gla and a model's training step call it: no h0, h_last unused."""
  x = jax.ShapeDtypeStruct((1, 4 * c, 2, dh), jnp.bfloat16)

  def fwd_bwd(q, k, v, g, do):
    o, vjp = jax.vjp(lambda *a: gpu.gla(dh**-0.5, c, False, *a, None, None)[0], q, k, v, g)
    return o, vjp(do)
  return fwd_bwd, (x, x, x, x, x)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--triton", required=True, help="folder holding the pip triton package")
  ap.add_argument("--dh", type=int, nargs="*", default=[64, 128])
  ap.add_argument("--variants", nargs="*", default=["fact"])
  args = ap.parse_args()
  sys.path.insert(0, args.triton)
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  ptxas = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                        "backends/nvidia/bin/ptxas*")))[-1]
  number = lambda text: int(re.search(r"\d+", text).group(0))
  work = tempfile.mkdtemp()
  for variant in args.variants:
    bench_gla.set_variant(variant)
    for dh in args.dh:
      for ir, config in triton_kernels(*fwd_bwd_args(dh, bench_gla.CHUNK)):
        warps, stages = number(config["num_warps"]), number(config["num_stages"])
        name = config["name"].strip('"')
        path = os.path.join(work, "kernel.ttir")
        with open(path, "w") as f:
          f.write(ir)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        with open(path + ".ptx", "w") as f:
          f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path + ".ptx", "-o", os.devnull],
                             capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        print(f"{variant:20s} Dh {dh:3d} {name:21s} warps {warps} stages {stages}: "
              f"{regs.group(1) if regs else '?'} registers, spill stores/loads "
              f"{spill.group(1) + ' / ' + spill.group(2) if spill else '?'} B, "
              f"shared {compiled.metadata.shared} B", flush=True)
        if not regs:
          print(out)


if __name__ == "__main__":
  main()
