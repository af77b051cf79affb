"""The training loss's cross-entropy with a one-pass log-sum-exp (Triton GPU; interpreted on a
CPU).

Public calls: ``cross_entropy(logits, targets, *, interpret=False)``, ``reference``,
``supported(vocab)`` and ``MIN_VOCAB``. TPUs take XLA's (``train.masked_cross_entropy``).
"""

from pallas_kernels.loss.lse import MIN_VOCAB, cross_entropy, reference, supported

__all__ = ["MIN_VOCAB", "cross_entropy", "reference", "supported"]
