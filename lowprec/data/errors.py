"""Data errors."""


class DataError(RuntimeError):
    """Missing, empty, corrupt or mismatched training data; the message says which path and why."""
