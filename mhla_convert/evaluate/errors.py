"""The one error type evaluation raises for input the user can fix."""


class EvalError(ValueError):
    """Bad evaluation input; the message names the problem and the fix."""
