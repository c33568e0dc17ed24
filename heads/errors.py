"""Errors raised by draft heads."""

from __future__ import annotations


class HeadError(ValueError):
    """A user-facing problem with a draft head: one line saying what is wrong and how to fix it.

    Subclasses ValueError so callers that already catch bad-argument errors keep working.
    """
