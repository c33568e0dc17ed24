"""The one exception type for user-facing data problems."""

from __future__ import annotations


class DataError(ValueError):
    """A bad data input or setting.

    The message is ONE line that says what is wrong and how to fix it; the CLI prints
    `error: <message>` and exits non-zero instead of showing a traceback.
    """
