"""Benchmarking: task sets (tasks.py), the benchmark runner and peer baselines."""
