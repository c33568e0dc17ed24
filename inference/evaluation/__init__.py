"""Decode prompt sets and measure them, report and profile, for the benchmark scripts and the trainer's
decode evaluation. Imports the engine, never the reverse (tests/test_import_cycles.py)."""
