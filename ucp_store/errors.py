"""Exception hierarchy. Every message names the thing (parameter, file, reference) and the expectation."""


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


class ReferenceNotFound(UcpError):
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
