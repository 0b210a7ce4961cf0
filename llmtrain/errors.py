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
    """Another process's error, handed to the processes that waited for its result (collectives.on_main: the main
    process's; collectives.on_first: a group's first's). The process that raised it prints it, and each node's
    first process (as before the process group exists), not every GPU of a launch."""


class Everywhere(LLMTrainError):
    """An error every process of a launch finds alike (a check of the same recipe and the same data, after the
    process group exists: data.checks' fails): each node's first process prints it, as before the group exists, not
    every GPU of a launch."""


class Stopped(LLMTrainError):
    """The run stopped on SIGTERM or Ctrl-C after saving a checkpoint; exits 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
