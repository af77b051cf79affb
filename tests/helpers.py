"""Shared test utilities: running the entry points as a user would."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# XLA's CPU backend without LLVM's optimisation passes: the tests' tiny programs compile about a
# quarter faster, and compiling, not running, is most of the suite's time (one test worker:
# 3773 compiles, 761 of its 1690 s, 2026-12-02). For the test processes (conftest.py) and the
# scripts they start (one device each).
FAST_COMPILE = "--xla_backend_optimization_level=0"


# Set in the test process by jax once a test has loaded libtpu (the compile-only TPU tests); a
# script started with them would load libtpu too, which a user's CPU run does not (and which
# made a deadlock of simulated devices' collectives more likely: docs/reliability.md).
_LIBTPU_VARIABLES = ("TPU_LIBRARY_PATH", "TPU_SKIP_MDS_QUERY")


def script_env(**extra: str) -> dict:
  """The environment of a script the tests start: the CPU, one device (as on a user's laptop),
  unbuffered output, FAST_COMPILE, and no libtpu unless the script loads it itself."""
  env = {k: v for k, v in os.environ.items() if k not in _LIBTPU_VARIABLES}
  return {**env, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "XLA_FLAGS": FAST_COMPILE,
          **extra}


def run_script(name: str, *args: str, check: bool = True, timeout: int = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs ``scripts/NAME`` in a fresh Python process; returns the completed process."""
  full_env = script_env(**(env or {}))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
  if check and proc.returncode != 0:
    raise AssertionError(f"{name} {' '.join(args)} exited {proc.returncode}:\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return proc


_TINY_TFDS_BUILDER = None


def build_tiny_tfds(root: str, train_docs: list[str], eval_docs: list[str]) -> str:
  """Prepares an ArrayRecord TFDS dataset ``data_test_tiny_text`` (splits train, validation)
  under ``root``, as ``tfds build`` would for c4; GeneratorBasedBuilder needs no TensorFlow.

  TFDS registers a builder class by name once per process, so the class is made once and
  each call sets the documents it writes.
  """
  global _TINY_TFDS_BUILDER
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  if _TINY_TFDS_BUILDER is None:

    class DataTestTinyText(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")
      documents: dict[str, list[str]] = {}

      def _info(self):
        features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

      def _split_generators(self, dl_manager):
        del dl_manager
        return {split: self._generate_examples(docs) for split, docs in self.documents.items()}

      def _generate_examples(self, docs):
        for i, doc in enumerate(docs):
          yield i, {"text": doc}

    _TINY_TFDS_BUILDER = DataTestTinyText
  _TINY_TFDS_BUILDER.documents = {"train": list(train_docs), "validation": list(eval_docs)}
  _TINY_TFDS_BUILDER(data_dir=root, file_format="array_record").download_and_prepare()
  return root


def cudnn_semantics(q, k, v, q_seqlen=None, kv_seqlen=None, q_offsets=None, kv_offsets=None,
                    *, scale, mask_type, sliding_window_length=None):
  """What jax's cuDNN attention computes, written in jnp for the CPU: causal within each
  packed segment (rows without offsets: one segment), ``sliding_window_length`` keys."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  del kv_seqlen, kv_offsets, mask_type
  b, t = q.shape[:2]
  i = jnp.arange(t)
  if q_offsets is None:
    seg = jnp.zeros((b, t), jnp.int32)
  else:
    inside = ((q_offsets[:, :-1, None] <= i) & (i < q_offsets[:, :-1, None] + q_seqlen[:, :, None])
              & (q_seqlen[:, :, None] >= 0))  # [B, M, T]
    seg = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1)
  allowed = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0) & (i[:, None] >= i)
  if sliding_window_length is not None:
    allowed &= i[:, None] - i < sliding_window_length
  logits = jnp.einsum("btnh,bsh->bnts", q, k[:, :, 0]) * scale
  probs = jax.nn.softmax(jnp.where(allowed[:, None], logits, -1e30), axis=-1)
  return jnp.einsum("bnts,bsh->btnh", probs, v[:, :, 0])


def cudnn_attention_on_cpu(monkeypatch, record=None):
  """Makes ``attention.fused_attention(..., implementation="cudnn")`` run on a CPU: jax's cuDNN
  attention becomes ``cudnn_semantics`` (called with ``record(q)`` first, if given) and the
  dense-mask branch the XLA implementation."""
  import jax._src.cudnn.fused_attention_stablehlo as cudnn  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import attention  # pylint: disable=g-import-not-at-top

  def fake(q, *args, **kwargs):
    if record is not None:
      record(q)
    return cudnn_semantics(q, *args, **kwargs)

  masked = attention.document_mask_attention
  monkeypatch.setattr(cudnn, "dot_product_attention", fake)
  monkeypatch.setattr(attention, "document_mask_attention",
                      lambda *a, **kw: masked(*a[:6], implementation="xla"))


def loss_grads_and_kernels(cfg, tokens, segment_pos):
  """A loss of ``Model(cfg)``'s logits (seed 0), its gradients, and how many Pallas calls its
  gradient's jaxpr holds: for comparing a kernel path with the XLA path it replaces."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from recurrentgemma_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  graphdef, params = nnx.split(model_lib.Model(cfg, rngs=nnx.Rngs(0)))

  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens, segment_pos)[0]
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] ** 2)
  # Jitted (op by op, a model's forward and backward dispatch thousands of small operations)
  # and traced once, for both the Pallas calls in its jaxpr and the program that runs.
  traced = jax.jit(jax.value_and_grad(loss)).trace(params)
  kernels = str(traced.jaxpr).count("pallas_call")
  return (*traced.lower().compile()(params), kernels)


def xla_and_kernel_runs(cfg, field, tokens, segment_pos):
  """``loss_grads_and_kernels`` of ``cfg`` with ``field`` (a ``model.*_impl``) set to ``xla``,
  then to ``pallas``: for comparing a kernel path with the XLA path it replaces."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  return tuple(loss_grads_and_kernels(dataclasses.replace(cfg, **{field: impl}), tokens,
                                      segment_pos) for impl in ("xla", "pallas"))


def assert_mosaic_on_hopper(monkeypatch, path, *shapes):
  """``path(*shapes)`` (a ``dispatch`` choice between a Mosaic GPU and a Triton kernel, setting
  "auto") takes Triton's interpreter on a CPU, and the Mosaic kernel on Hopper GPUs only."""
  from pallas_kernels import dispatch  # pylint: disable=g-import-not-at-top
  assert path(*shapes) == "triton"
  monkeypatch.setattr(dispatch, "target_platform", lambda: "gpu")
  for capability, want in ((9.0, "mosaic"), (8.0, "triton"), (10.0, "triton")):
    monkeypatch.setattr(dispatch, "gpu_capability", lambda c=capability: c)
    assert path(*shapes) == want


def lower_for_cuda(fn, *args) -> str:
  """``jax.jit(fn)`` traced at ``args`` (arrays or ShapeDtypeStructs) and lowered for CUDA on
  this CPU machine, as text. jax 0.10 lowers Triton calls without a GPU; jax 0.11's Triton
  lowering asks for the GPU's kind and finds none here, so the lowering is retried with an
  abstract H100 named as the target."""
  import jax  # pylint: disable=g-import-not-at-top
  lower = lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  try:
    return lower()
  except RuntimeError as e:
    if "No supported GPU devices found" not in str(e):
      raise
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                     platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=h100)
  with jax.sharding.use_abstract_mesh(mesh):
    return lower()


def assert_grads_close(got, want, rtol=1e-4, atol=1e-6):
  """Every leaf of the gradient tree ``got`` close to the same leaf of ``want``."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
