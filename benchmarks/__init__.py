"""Reproducible measurements of jamp's modes; each script writes tables to ``results/``."""
