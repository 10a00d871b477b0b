"""Errors that a user can cause and should read as one clear line, not a traceback."""

from __future__ import annotations

from collections.abc import Mapping
from string import Formatter


class UserError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""


class ArgumentError(UserError, ValueError):
    """A value given to p2ptrain is refused, in words that name the argument the way its caller
    spelt it: ``bootstrap=`` to Python code (``str()``, what a traceback shows), ``--bootstrap``
    on the command line (:meth:`worded` with ``command_line=True``, what ``p2ptrain`` prints).

    Why one template and not a message per caller: the same check runs under both (a Node's
    bootstrap list from ``node start`` or from ``p2ptrain.Optimizer``), and two copies of each
    text drift apart. The template is ``str.format`` text: a field given as a keyword is a value;
    any other field names an argument, ``{bootstrap}`` alone (``bootstrap=`` / ``--bootstrap``) or
    ``{bootstrap:VALUE}`` with what was given (``bootstrap=VALUE`` / ``--bootstrap VALUE``); a
    flag is the argument's name with dashes (``max_batch``: ``--max-batch``) unless ``flags`` says
    otherwise (``{"ipfs_api": "--ipfs"}``). A ValueError too: a value was wrong, and code that
    caught ValueError before still does.
    """

    def __init__(self, template: str, /, *, flags: Mapping[str, str] | None = None, **values: object) -> None:
        self.template = template
        self.values = values
        self.flags = dict(flags or {})
        super().__init__(self.worded(command_line=False))

    def worded(self, *, command_line: bool) -> str:
        """The message with each argument named for the caller: a flag, or a keyword argument."""
        names = {}
        for _, field, _, _ in Formatter().parse(self.template):
            if field and field not in self.values:
                flag = self.flags.get(field) or "--" + field.replace("_", "-")
                names[field] = _Named(flag if command_line else None, field)
        return self.template.format(**self.values, **names)


def command_line_words(exc: BaseException) -> str:
    """What ``p2ptrain`` says of ``exc``: its message, with an argument it names named by its flag."""
    return exc.worded(command_line=True) if isinstance(exc, ArgumentError) else str(exc)


class _Named:
    """An argument in a message: its flag on a command line (``--bootstrap VALUE``), else its
    keyword (``bootstrap=VALUE``)."""

    def __init__(self, flag: str | None, keyword: str) -> None:
        self.flag = flag
        self.keyword = keyword

    def __format__(self, value: str) -> str:
        if self.flag is not None:
            return f"{self.flag} {value}" if value else self.flag
        return f"{self.keyword}={value}"


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first error a nursery tree carries: trio wraps what a task raises in one group per nursery
    it crosses, and a user's mistake (a taken port, a home in use) should still read as one line."""
    first = group.exceptions[0]
    return first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
