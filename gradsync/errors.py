"""gradsync's own errors: one base class, and the one place that adds the "gradsync: " prefix.

Callers catch the class, never the text: ``except gradsync.GradsyncError`` catches everything gradsync raises
itself, and each subclass says which kind of failure it is. Errors about a bad argument also derive from
``ValueError`` (as torch's DDP raises them), so existing ``except ValueError`` handlers keep working.
"""

from __future__ import annotations


class GradsyncError(RuntimeError):
    """Base class of every error gradsync raises itself; ``str(error)`` starts with ``"gradsync: "``.

    Example::

        try:
            loss.backward()
        except gradsync.GradsyncError as error:
            print(error.message)   # the text without the prefix
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"gradsync: {self.message}"


class CollectiveError(GradsyncError):
    """A collective failed or timed out; the message names the operation, this rank and what the peers said."""


class DesyncError(GradsyncError):
    """``GRADSYNC_DEBUG``: the ranks were about to issue different collectives (they drifted out of step)."""


class GradientError(GradsyncError):
    """A gradient arrived in a way the reducer cannot average: never, twice, or after the reduction."""


class ModelMismatchError(GradsyncError, ValueError):
    """The ranks built different models (parameters or buffers differ in name, shape, dtype or device)."""


class ConfigError(GradsyncError, ValueError):
    """An argument or environment variable gradsync cannot honour; the message names it and the fix."""


class CheckpointError(GradsyncError):
    """A checkpoint could not be written or read; the message names the file and what is wrong with it."""
