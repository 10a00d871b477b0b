"""Errors that a user can cause and should read as one clear line, not a traceback."""


class UserError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first error a nursery tree carries: trio wraps what a task raises in one group per nursery
    it crosses, and a user's mistake (a taken port, a home in use) should still read as one line."""
    first = group.exceptions[0]
    return first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
