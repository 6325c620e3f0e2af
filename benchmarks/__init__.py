"""Benchmark scripts. Each prints its baseline beside its result and writes benchmarks/results/*.md."""
