"""The errors of a model name and its arguments (their own module: the registry, the hf builder it
registers and the installed packages' builders all raise them)."""

from p2ptrain.base import UserError


class ModelError(UserError):
    """A model name or its arguments are not acceptable; the message names the field."""


class MissingBuilder(ModelError):
    """A task names a builder this node does not have (no installed package provides it, or the
    package it needs is not installed); the message says what to install. The task may be sound:
    this node just cannot build its model."""

    def __init__(self, name: str, line: str) -> None:
        super().__init__(f"model.name: {line}")
        self.name = name
        self.line = line  # without the field name: what `task status` shows
