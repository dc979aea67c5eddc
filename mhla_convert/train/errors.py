"""The one error type the training commands turn into a single line (no traceback)."""


class TrainError(Exception):
    """A problem the user can fix: the message says what to change."""


class RecipeError(TrainError):
    """A recipe that does not match the schema; the message names the key, the allowed values and the line."""
