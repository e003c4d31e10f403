"""Errors a user can cause and fix. The CLI prints these as one line and exits non-zero."""


class UserError(ValueError):
    """Bad input: a wrong argument, a missing file, incompatible models."""
