"""Data errors."""

from lowprec.errors import UserError


class DataError(UserError, RuntimeError):
    """Missing, empty, corrupt or mismatched training data; the message says which path and why."""
