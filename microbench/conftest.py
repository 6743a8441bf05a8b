"""Benchmarks run through the harness engine; pytest-benchmark stores device samples (harness/pytest_plugin.py)."""
from harness.pytest_plugin import (device_benchmark, pytest_benchmark_update_machine_info,  # noqa: F401
                                   pytest_sessionstart)
