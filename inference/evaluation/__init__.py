"""Measurement: decode prompt sets and measure them (measure.py), report (report.py), profile (profiling.py).

Shared by the benchmark scripts and the trainer's decode evaluation; imports the engine, never the reverse
(tests/test_import_cycles.py).
"""
