"""Errors a user can fix: the CLI prints them as one line and exits 2 (anything else is a bug: traceback)."""


class InputError(ValueError):
    """A bad spec, file, column or setting; the message names it and says what is expected."""
