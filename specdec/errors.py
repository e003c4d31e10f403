"""Errors a user can cause and fix. The CLI prints these as one line and exits non-zero."""


class UserError(ValueError):
    """Bad input: a wrong argument, a missing file, incompatible models."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message ('' for none): enough for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
