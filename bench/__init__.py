"""Benchmarks: `python -m bench.<name>`, results as JSON under bench/results/."""
