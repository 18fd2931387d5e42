"""Every error the pipeline raises on purpose.

Each class carries fields and subclasses the builtin it resembles, so callers can catch
either. The CLI prints one line per error, ``error: <what>: <why> (<hint>)``, and exits
with ``exit_code``: 2 for bad input, 1 for failures of the outside world (retriable).
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base class. ``what`` names the thing, ``why`` the problem, ``hint`` the fix."""

    exit_code = 1

    def __init__(self, what: str, why: str, hint: str | None = None) -> None:
        self.what = what
        self.why = why
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        line = f"{self.what}: {self.why}"
        return f"{line} ({self.hint})" if self.hint else line

    def __reduce__(self) -> tuple:
        # Pickled whole (fields and class), whatever a subclass's __init__ takes: the serving
        # engine's process sends its load error to the server's, which exits by its code.
        return _rebuild, (type(self), self.__dict__, self.args)


def _rebuild(cls: type, fields: dict, args: tuple) -> PipelineError:
    e = cls.__new__(cls)
    e.__dict__.update(fields)
    e.args = args
    return e


class InputError(PipelineError, ValueError):
    """The user's input is wrong; retrying will not help (exit 2)."""

    exit_code = 2


class ConfigError(InputError):
    """A config or grid file is invalid; names the file, line and field."""

    def __init__(
        self,
        path: str,
        why: str,
        hint: str | None = None,
        *,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.path = path
        self.line = line
        self.field = field
        where = f"{path}:{line}" if line else path
        if field:
            where = f"{where}: {field}"
        super().__init__(where, why, hint)


class PlanError(InputError):
    """A plan cannot be made from these numbers (heads, tp, instance)."""


class CheckpointError(InputError, FileNotFoundError):
    """A model checkpoint directory is missing or unusable."""


class UnsupportedArchitectureError(InputError):
    """The checkpoint's architecture has no padding or compile support."""


class TraceError(InputError):
    """A request trace file cannot be read."""


class BackendUnavailableError(InputError):
    """The requested compile backend cannot run on this machine (missing SDK, no GPU)."""


class CompileError(PipelineError):
    """One or more buckets failed to compile."""

    def __init__(self, what: str, why: str, hint: str | None = None, *, failed=()) -> None:
        self.failed = tuple(failed)
        super().__init__(what, why, hint)


class StoreError(PipelineError):
    """The artifact store could not be read or written (network, permissions)."""


class NotFoundError(InputError, LookupError):
    """A model, release, channel or blob does not exist in the store."""


class AlreadyExistsError(InputError, FileExistsError):
    """A release version already exists; releases are immutable."""


class ConflictError(PipelineError):
    """A compare-and-swap lost a race (a channel moved underneath us); retry."""


class IntegrityError(PipelineError):
    """Bytes did not match their recorded sha256 or size."""


class MissingBucketsError(InputError):
    """A release cannot be assembled: some buckets have no compile cache entry."""


class ManifestError(InputError):
    """A release manifest (or a channel pointer) is malformed (invalid JSON, a missing,
    unknown or mistyped field): republishing fixes it, retrying never does (exit 2)."""


class RuntimeMismatchError(InputError):
    """This runtime cannot run the release (backend, torch or compiler version)."""


class TraceNotFoundError(TraceError, FileNotFoundError):
    """A request trace file does not exist or cannot be opened."""


class TraceColumnError(TraceError, LookupError):
    """A trace lacks a requested column; ``columns`` lists the ones it has."""

    def __init__(self, what: str, why: str, hint: str | None = None, *, columns=()) -> None:
        self.columns = tuple(columns)
        super().__init__(what, why, hint)


class TraceValueError(TraceError):
    """A trace cell is not a whole number of tokens ≥ 0; ``line`` is the file's line."""

    def __init__(self, what: str, why: str, hint: str | None = None, *, line: int = 0) -> None:
        self.line = line
        super().__init__(what, why, hint)


class EmptyTraceError(TraceError):
    """A trace has no requests to fit (no header, or a header and no rows)."""


class VerificationError(InputError):
    """A release is not what its signer published: an unsigned release where a key is
    trusted, a signature that does not verify or is by an untrusted key, a channel pointer
    whose manifest digest differs. Nothing is installed; retrying never helps (exit 2)."""
