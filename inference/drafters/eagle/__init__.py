"""EAGLE-1/2 and EAGLE-3 drafting: ONE drafter class (drafter.py) for any number of rows."""

from spechead.inference.drafters.eagle.drafter import EagleDrafter

__all__ = ["EagleDrafter"]
