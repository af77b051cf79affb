"""recurrentgemma_jax: Griffin, Hawk, MQA and GLA language models in JAX/Flax."""

import setuptools

# The jax release the TPU compile (libtpu) is tested with: `pip install -e ".[tpu]"` pins it.
TPU_JAX_VERSION = "0.10.2"

setuptools.setup(
    name="recurrentgemma_jax",
    version="0.1.0",
    description=(
        "Train and serve Griffin, Hawk, MQA-Transformer and Gated Linear"
        " Attention language models with JAX, Flax NNX and Pallas."
    ),
    python_requires=">=3.11",
    packages=setuptools.find_packages(
        include=["recurrentgemma_jax*", "pallas_kernels*", "sharding*"]
    ),
    install_requires=[
        "jax>=0.10",
        "flax>=0.12",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "ml_collections>=1.0",
        "grain>=0.2.10",
        "jaxtyping>=0.2.36",
        "einops>=0.8",
        "numpy>=1.26",
        "sentencepiece>=0.2",
        "safetensors>=0.4",  # transformers checkpoints (recurrentgemma_jax/hf.py), NumPy API
        "pyarrow>=15",
        "tensorboardX>=2.6",
        "matplotlib>=3.7",
    ],
    extras_require={
        # TFDS datasets (c4 ...), read through tfds.data_source without TensorFlow.
        "tfds": ["tensorflow-datasets>=4.9.7"],
        # libtpu: runs on TPU VMs, and compiles for TPU topologies on any machine
        # (scripts/compile_tpu.py, the TPU compile tests).
        "tpu": [f"jax[tpu]=={TPU_JAX_VERSION}"],
        "test": [
            f"jax[tpu]=={TPU_JAX_VERSION}",
            "pytest>=8",
            "pytest-xdist>=3",
            # The official package is a test dependency: our importer and
            # evaluator are checked against it. It is installed with --no-deps
            # by .ci/run (its pins on numpy/pytest are stricter than needed);
            # these are the imports it actually needs.
            "typeguard<3",
            "absl-py",
            "tensorflow-datasets>=4.9.7",
        ],
    },
)
