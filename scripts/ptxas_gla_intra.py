"""Registers and spills of gla_gpu_intra's Triton kernels, without a GPU.

    pip install --target /tmp/tri --no-deps triton==3.9.0      # once (about 290 MB)
    python scripts/ptxas_gla_intra.py --triton /tmp/tri [--dh 64 128] [--warps 4 8]
        [--diag rows kpieces] [--resets] [--dtype float32]

Lowers each kernel with Pallas to Triton IR (on the CPU, for an sm_90 target), compiles that
IR text to PTX with the pip Triton, and runs the bundled ptxas -v for sm_90a: it prints the
registers per thread and the spill bytes. The pip Triton is not the one inside jaxlib that
compiles the kernels on the GPU machine, so the numbers are indicative; a failure here is
still worth a look before spending GPU time.
"""

import argparse
import functools
import glob
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import pallas_call_registration as registration

from pallas_kernels import gla_gpu_intra

F32 = jnp.float32


def triton_ir(fn, args):
  """The Triton IR text of the one pallas_call in fn(*args), lowered for CUDA."""
  captured = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*a, **kw):
    result = lower(*a, **kw)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  assert len(captured) == 1, len(captured)
  return captured[0]


def kernels(dh, resets, dtype=jnp.bfloat16, b=2, t=256, h=2, c=64):
  nt = t // c
  s = jax.ShapeDtypeStruct
  tok, state = s((b, t, h, dh), dtype), s((b, h, nt, dh, dh), F32)
  edge, gates = s((b, h, dh, dh), F32), s((b, h, nt, c, dh), F32)
  rc = s((b, t), F32) if resets else None
  kw = dict(scale=dh**-0.5, chunk=c)
  yield "forward", functools.partial(gla_gpu_intra.forward, **kw), (
      tok, tok, tok, gates, state, edge, rc)
  yield "backward", functools.partial(gla_gpu_intra.backward, **kw), (
      tok, tok, tok, tok, gates, state, edge, state, edge, s((b, h, nt, c, c), dtype), rc)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--triton", required=True, help="folder holding the pip triton package")
  ap.add_argument("--dh", type=int, nargs="*", default=[64])
  ap.add_argument("--warps", type=int, nargs="*", default=[4])
  ap.add_argument("--diag", nargs="*", default=["rows"])
  ap.add_argument("--resets", action="store_true")
  ap.add_argument("--dtype", default="bfloat16")
  args = ap.parse_args()
  sys.path.insert(0, args.triton)
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  ptxas = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                        "backends/nvidia/bin/ptxas*")))[-1]
  work = tempfile.mkdtemp()
  for diag in args.diag:
    gla_gpu_intra.DIAG = diag
    for dh in args.dh:
      for name, fn, fargs in kernels(dh, args.resets, jnp.dtype(args.dtype)):
        if name == "backward" and diag != args.diag[0]:
          continue  # DIAG only changes the forward
        path = os.path.join(work, f"{name}.ttir")
        with open(path, "w") as f:
          f.write(triton_ir(fn, fargs))
        for warps in args.warps:
          compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=warps, num_stages=1))
          ptx = os.path.join(work, f"{name}.ptx")
          with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
          out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull],
                               capture_output=True, text=True).stderr
          regs = re.search(r"Used (\d+) registers", out)
          spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
          print(f"{name:8s} {args.dtype} diag={diag:7s} Dh={dh:3d} warps={warps} "
                f"resets={args.resets}: "
                f"{regs.group(1) if regs else '?'} registers, spill stores/loads "
                f"{spill.group(1) + ' / ' + spill.group(2) if spill else '?'} bytes, "
                f"shared {compiled.metadata.shared} B", flush=True)
          if not regs:
            print(out)


if __name__ == "__main__":
  main()
