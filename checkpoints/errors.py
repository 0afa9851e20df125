"""Exceptions raised by the checkpoint store.

Every error names the checkpoint step and, where one is involved, the file, so that a user can
decide what to do (pick an older step with `--resume-from`, delete a damaged directory, raise a
timeout). `ValueError` is still used for bad arguments; these classes are for the state of the
checkpoint directory itself.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of all checkpoint-store failures that are not bad arguments."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested checkpoint (or any complete checkpoint) does not exist in the directory."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A writer was opened for a step that is already committed; committed steps are immutable."""


class CorruptCheckpointError(CheckpointError):
    """A shard or manifest failed its checksum, is truncated, unreadable or missing.

    `location` is the file (path or store URL) and `step` the checkpoint step; both also appear
    in the message.
    """

    def __init__(self, message: str, *, step: int, location: str) -> None:
        super().__init__(f"checkpoint step {step}: {location}: {message}")
        self.step = step
        self.location = location


class CommitError(CheckpointError):
    """Rank 0 could not commit a checkpoint (missing ranks, inconsistent or incomplete slices)."""


class CommitTimeoutError(CommitError, TimeoutError):
    """Not every rank wrote its done marker before the commit deadline; `missing_ranks` says who."""

    def __init__(self, message: str, *, step: int, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.step = step
        self.missing_ranks = missing_ranks
