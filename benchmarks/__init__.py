"""Benchmarks for fused_accum: kernel microbenchmarks and an end-to-end training window.

Run ``python benchmarks/run.py`` (or ``python -m fused_accum bench``); see :mod:`benchmarks.run`.
Every performance claim in the README and in issue notes comes from this suite.
"""
