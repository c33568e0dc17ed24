"""Tuning, calibration and search: measure this device and a head to pick trees and skip sets. Imports
the engine, never the reverse (tests/test_import_cycles.py); loading.py wires it in."""
