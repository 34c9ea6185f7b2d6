"""Benchmarks behind `kvserve bench`: roofline, throughput, serve, prefix, compare, profile,
scheduler and kv. Each module's `run(...)` returns a JSON-ready dict; `cli.py` prints,
saves and plots it."""
