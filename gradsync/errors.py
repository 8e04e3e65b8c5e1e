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
    """A collective failed or timed out; the message names the operation, this rank and what the peers said.

    Example::

        try:
            loss.backward()    # a peer died or hung: every survivor raises, naming the operation and bucket
        except gradsync.errors.CollectiveError as error:
            print(error.message)
    """


class DesyncError(GradsyncError):
    """``GRADSYNC_DEBUG``: the ranks were about to issue different collectives (they drifted out of step).

    Example::

        # GRADSYNC_DEBUG=1 gradsync run --nproc-per-node 2 train.py: a rank that skips a backward the others run
        try:
            loss.backward()
        except gradsync.errors.DesyncError as error:
            print(error.message)    # each rank's intent, instead of a hang
    """


class GradientError(GradsyncError):
    """A gradient arrived in a way the reducer cannot average: never, twice, or after the reduction.

    Example::

        class TwoHeads(nn.Module):   # the second head gets no gradient
            def __init__(self):
                super().__init__()
                self.used, self.unused = nn.Linear(8, 1), nn.Linear(8, 1)

            def forward(self, x):
                return self.used(x)

        ddp = gradsync.DistributedDataParallel(TwoHeads())
        try:
            ddp(x).sum().backward()
        except gradsync.errors.GradientError as error:
            print(error.message)   # names unused.weight and unused.bias, and the flag that fixes it
    """


class ModelMismatchError(GradsyncError, ValueError):
    """The ranks built different models (parameters or buffers differ in name, shape, dtype or device).

    Example::

        try:
            ddp = gradsync.DistributedDataParallel(model)   # refused on every rank when the ranks' models differ
        except gradsync.errors.ModelMismatchError as error:   # also a ValueError
            print(error.message)
    """


class ConfigError(GradsyncError, ValueError):
    """An argument or environment variable gradsync cannot honour; the message names it and the fix.

    >>> gradsync.DistributedDataParallel(model, bucket_cap_mb=-1)
    Traceback (most recent call last):
    ...
    gradsync.errors.ConfigError: gradsync: bucket_cap_mb must be a finite number > 0 (MiB per bucket), ...
    """


class CheckpointError(GradsyncError):
    """A checkpoint could not be written or read; the message names the file and what is wrong with it.

    Example::

        try:
            checkpoint.save("/proc/ckpt.pt", model=ddp)   # a directory nobody may write to
        except gradsync.errors.CheckpointError as error:
            print(error.message)   # names the file and what went wrong
    """
