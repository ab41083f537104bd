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
