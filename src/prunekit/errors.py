"""Errors raised by prunekit and by its exported runtime.

Stdlib only: this module is copied into every exported package's ``runtime/``.
The CLI catches :class:`PrunekitError` alone, prints its message on one line and
exits non-zero; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class PrunekitError(Exception):
    """Base class of every error a user can act on."""


class CheckpointError(PrunekitError):
    """A checkpoint is missing, truncated, corrupt, unsafe to load, or of an unknown kind."""


class PatternError(PrunekitError):
    """A sparsity pattern string or sparsity value is invalid, or does not fit a tensor."""


class FormatError(PrunekitError):
    """A sparse storage format cannot encode or decode a tensor."""


class IntegrityError(PrunekitError):
    """A package's manifest is missing or invalid, or a file's sha256 does not match it."""


class KernelUnavailable(PrunekitError):
    """A GPU kernel was requested but no GPU, compiler or prebuilt extension is available."""


class OutputExistsError(PrunekitError):
    """The output path already exists and ``overwrite`` was not given."""
