"""User-facing errors: every mistake a user can cause raises a WaferlineError subclass."""


class WaferlineError(Exception):
    """Base class: the message says what was wrong and what to do. The CLI prints it without a traceback."""


class ConfigError(WaferlineError):
    """A model config, hardware spec or plan is malformed or unsupported."""


class CheckpointError(WaferlineError):
    """A checkpoint directory is missing files, has wrong tensors, or is corrupt."""


class FitError(WaferlineError):
    """A model does not fit on the requested hardware."""


class RequestError(WaferlineError):
    """A generation request is invalid (prompt too long, bad sampling parameters, ...)."""


class UsageError(WaferlineError):
    """Command-line flags that contradict each other, or that the chosen mode would silently ignore."""


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun in the right number, for messages: ``1 stage``, ``2 stages``, ``1 process``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
