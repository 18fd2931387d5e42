"""inf2-pipeline: ahead-of-time compilation and artifact pipeline for AWS Inferentia2."""

__version__ = "0.1.0"
