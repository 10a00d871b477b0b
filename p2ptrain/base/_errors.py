"""Errors that a user can cause and should read as one clear line, not a traceback."""


class UserError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""
