"""recurrentgemma_jax: Griffin, Hawk, MQA-Transformer and GLA language models."""
