"""Tuning, calibration and search: measure this device and a head to pick trees and skip sets.

Imports the engine (spechead.inference); the engine never imports this package
(tests/test_import_cycles.py). The loading layer (loading.py) wires it in.
"""
