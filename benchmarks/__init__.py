"""Benchmark scripts, run as modules from the repository root so that they can import the
test support package (``tests.support``): ``python -m benchmarks.bench_load``."""
