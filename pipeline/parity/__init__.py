"""Parity: a compiled release against the eager Hugging Face model, bucket by bucket.

``check`` runs the buckets and writes the report, ``reference`` is the fp32 model, and
``runners`` run a release's buckets per backend.
"""

from pipeline.parity.check import (
    DEFAULT_STEPS,
    TOLERANCES,
    BucketParity,
    ParityReport,
    Tolerance,
    check_release,
    prompt_lengths,
    tolerance_dtype,
)
from pipeline.parity.reference import Reference

__all__ = [
    "DEFAULT_STEPS",
    "TOLERANCES",
    "BucketParity",
    "ParityReport",
    "Reference",
    "Tolerance",
    "check_release",
    "prompt_lengths",
    "tolerance_dtype",
]
