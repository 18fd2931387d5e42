"""The serving runtime: an installed release → the nearest compiled bucket for each request.

``pipeline.runtime.BucketedModel`` is the public entry point (the serving pod's docs name it).
"""

from pipeline.runtime.bucketed import BucketedModel

__all__ = ["BucketedModel"]
