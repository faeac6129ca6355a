"""The exceptions weir raises."""


class WeirError(Exception):
    """Something the engine could not do; the message names the batch, file, key or setting."""


class ConfigError(WeirError, ValueError):
    """A setting is missing or wrong; the message names the option and the reason."""


class SinkError(WeirError):
    """A sink could not write a batch. Let it propagate out of your function: the batch is
    then not committed and runs again on the next start."""


class StreamingQueryException(WeirError):
    """The query stopped because a batch failed. ``__cause__`` is the exception your
    function raised (when it was yours); the message names the batch and carries the
    Python traceback."""
