"""Errors that name their culprit: file and line, spec field, sample id."""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every deliberate pipeline error."""


class SpecError(PipelineError):
    """A benchmark spec is wrong; the message names the file and the field."""


class DataError(PipelineError):
    """A dataset row is wrong; the message names the file and line."""

    def __init__(self, path: str, line: int | None, reason: str):
        self.path = path
        self.line = line
        self.reason = reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")


class ArtifactError(PipelineError):
    """An artifact directory is unusable (e.g. resume against a different configuration)."""


class OwnershipError(PipelineError):
    """A directory is owned by another process (its lock is held); the message names the holder."""


class ArtifactWriteError(ArtifactError):
    """The disk refused a record (full, gone): the run stops, what was written stays, a resume finishes it."""
