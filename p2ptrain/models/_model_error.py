"""The one error of a model name and its arguments (its own module: the registry and the hf builder
it registers both raise it)."""

from p2ptrain.base import UserError


class ModelError(UserError):
    """A model name or its arguments are not acceptable; the message names the field."""
