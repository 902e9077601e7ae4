"""Typed errors shared by every layer.

Each error says what was wrong and what is allowed, so the CLI can print one line and exit 2
instead of a traceback. Catch `TesseraError` to catch all of them.
"""


class TesseraError(Exception):
    """Base class of every error Tessera raises on bad input."""


class ConfigError(TesseraError, ValueError):
    """A configuration key is unknown, has the wrong type, or a value out of range."""


class ModelError(TesseraError, ValueError):
    """A model's shape, architecture or weights do not fit what was asked."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, damaged, or belongs to another model."""


class DataError(TesseraError):
    """A dataset or tokenizer file is missing, truncated or malformed."""


class ImageError(DataError, ValueError):
    """An image that cannot be used: not an image, truncated, zero-sized, or past the pixel limit."""


class ServingError(TesseraError, RuntimeError):
    """A request the engine could not serve: the model's numbers went inf/NaN, a rank failed."""


class ParallelError(TesseraError, ValueError):
    """A parallel layout does not divide the world size or the model's shapes."""


class TrainingError(TesseraError, RuntimeError):
    """A run cannot go on: a gradient that is not finite where train.skip_nonfinite is false, loss
    spikes that come back however often the run rolls back, a failure that repeats at the same step."""


class EvaluationError(TesseraError):
    """An evaluation cannot run as asked: generated code cannot be sandboxed, a task's data is missing."""


class RequestError(ConfigError):
    """A request the engine refuses as asked (a prompt too long, a token id past the vocabulary,
    an adapter not loaded, a bad sampling value); `field` names the request field at fault, so that
    the HTTP server answers with it as the error's `param` (None: no one field is)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def require(cond: bool, key: str, value: object, allowed: str, error: type[TesseraError] = ConfigError,
            sep: str = "=") -> None:
    """Refuse a value unless `cond`: raise `error` saying `key=value is invalid: allowed`, the one
    form every configuration check uses (the key as the user spells it, the value as given, what
    is allowed). `sep` joins key and value (" " for a command-line option: `--layers 5`)."""
    if not cond:
        raise error(f"{key}{sep}{value!r} is invalid: {allowed}")
