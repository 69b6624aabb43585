"""Benchmarks: run by hand (`make bench` or `python -m bench.<name>`); they print tables."""
