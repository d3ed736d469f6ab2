"""Benchmarks: ``pdserve bench engine|cluster|kvstore|kernels`` (see :mod:`benchmarks.cli`)."""
