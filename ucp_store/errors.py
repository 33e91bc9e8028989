"""Exception hierarchy. Every message names the thing (parameter, file, reference) and the expectation.

Every error ucp_store raises on purpose is a :class:`UcpError`; the subclasses say which *kind* of
failure it is, so callers catch what they mean (``except ConflictError`` to retry a save at another
step, ``except LookupError`` for any unknown reference) instead of parsing messages. This module imports
nothing, so every other module (the catalog-only command line included) can raise these for free.
"""

__all__ = [
    "UcpError", "PlanError", "PatternError", "TopologyError", "CatalogError", "SchemaVersionError",
    "ValidationError", "InvalidNameError", "ReferenceNotFound", "DTypeError", "ShapeMismatch", "ChecksumError",
    "UnsafePickleError", "SourceFormatError", "ConfigurationError", "ConflictError", "StepCommittedError",
    "TagInUseError", "CommitRaceError", "WriterClosedError", "DuplicateEntryError", "TaggedCheckpointError",
    "ReadError", "WriteError", "QueryError", "ImportFailedError", "StalePlanError",
]


class UcpError(Exception):
    """Base class of every error ucp_store raises on purpose."""


class PlanError(UcpError):
    """A read plan cannot be built for the requested topology."""


class PatternError(UcpError):
    """A pattern record is malformed or does not fit the tensor."""


class TopologyError(UcpError):
    """A topology record is malformed or cannot split a tensor."""


class CatalogError(UcpError):
    """The SQL catalog is missing, inconsistent or unreachable."""


class SchemaVersionError(CatalogError):
    """The catalog was written by a newer (or unknown) schema revision."""


class ValidationError(UcpError):
    """A public record does not match its JSON Schema."""


class InvalidNameError(UcpError):
    """A run, tensor, state or tag name is invalid (e.g. would escape the store)."""


class ReferenceNotFound(UcpError, LookupError):
    """A checkpoint reference (RUN@STEP, RUN@latest, RUN:TAG, id) matches nothing."""


class DTypeError(UcpError):
    """A dtype the format cannot store bit-exactly."""


class ShapeMismatch(UcpError):
    """A tensor's shape or dtype does not match what was declared."""


class ChecksumError(UcpError):
    """A chunk or content hash does not match: the data is corrupt."""


class UnsafePickleError(UcpError):
    """A foreign file asks to unpickle a global outside the allow-list."""


class SourceFormatError(UcpError):
    """A foreign checkpoint (torch file, DeepSpeed folder) is missing, truncated or of an unknown layout."""


class ConfigurationError(UcpError):
    """A setting, URL or environment is wrong (not the data): e.g. no process group where one is needed."""


class ConflictError(UcpError):
    """The operation conflicts with what the catalog already holds (a committed step, a tag, a race)."""


class StepCommittedError(ConflictError):
    """``begin``: the run already has a committed checkpoint at this step."""


class TagInUseError(ConflictError):
    """``tag``: the tag already names another checkpoint (``force=True`` moves it)."""


class TaggedCheckpointError(ConflictError):
    """``rm``: the checkpoint is tagged (untag it or ``force=True``)."""


class CommitRaceError(ConflictError):
    """``commit``/``flush``: a concurrent save, rm or gc changed what this save relied on; retry it."""


class DuplicateEntryError(ConflictError):
    """A tensor-state or object was written twice into one checkpoint."""


class WriterClosedError(UcpError):
    """A checkpoint writer was used after commit, abort or close (or a joined rank tried to commit)."""


class ReadError(UcpError):
    """Reading an array (or a range of it) failed for a reason other than corruption (I/O, missing file)."""


class WriteError(UcpError):
    """Writing an array failed (I/O, permissions, a full disk, a refused bucket)."""


class QueryError(UcpError):
    """A read-only catalog query failed (bad SQL, or it tried to write)."""


class ImportFailedError(UcpError):
    """A distributed import or save failed on some rank; every rank raises it and nothing is listed.
    The rank that failed first chains the original error (``__cause__``)."""


class StalePlanError(UcpError):
    """A multi-rank save's cached plan no longer fits the state dict (its layout, or which entries are equal
    on every rank, changed): every rank aborted the attempt; ``ucp_store.distributed.save`` plans afresh."""
