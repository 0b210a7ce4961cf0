"""User-facing errors: anything raised as `LLMTrainError` is printed as one paragraph, no traceback."""


class LLMTrainError(Exception):
    """An error caused by the user's input (recipe, files, flags). The CLI prints it and exits 2."""

    exit_code = 2


class RecipeError(LLMTrainError):
    """The recipe or a `key=value` override is invalid."""


class TrainingDiverged(LLMTrainError):
    """A step's loss or gradient norm was not finite (more often than train.max_bad_steps allows)."""

    exit_code = 3


class Relayed(LLMTrainError):
    """Another process's error, the same for every process: the main process's, handed to the others
    (collectives.main_first). Each node's first process prints it, as before the process group exists."""


class Stopped(LLMTrainError):
    """The run stopped on SIGTERM or Ctrl-C after saving a checkpoint; exits 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
