"""User-facing errors: anything raised as `LLMTrainError` is printed as one paragraph, no traceback."""


class LLMTrainError(Exception):
    """An error caused by the user's input (recipe, files, flags). The CLI prints it and exits 2."""

    exit_code = 2


class RecipeError(LLMTrainError):
    """The recipe or a `key=value` override is invalid."""
