"""The error the CLI turns into one `error: ...` line and a non-zero exit."""


class TrainError(ValueError):
    """A user-facing training problem: the message says what is wrong and how to fix it."""
