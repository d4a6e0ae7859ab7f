"""Benchmarks of tfdist_ext: ``python -m benchmarks.run NAME [--quick]``."""
