"""Exceptions of the native kvfs API.

Every failure of a ``kvfs.Client`` call raises a :class:`KvfsError` subclass. Each carries
``kind`` (the kvfs client error kind, e.g. ``"not_found"``), ``code`` (the reference store's
numeric error code for that kind, e.g. ``-704``, the value ``MooncakeDistributedStore`` calls
return) and ``retryable`` (whether the same call may succeed later unchanged).
"""

import builtins


class KvfsError(Exception):
    """A kvfs call failed; see ``kind``, ``code`` and ``retryable``."""

    def __init__(self, message, kind="internal", code=-1, retryable=False):
        super().__init__(message)
        self.kind = kind
        self.code = code
        self.retryable = retryable

    def __str__(self):
        return self.args[0] if self.args else self.kind


class NotFoundError(KvfsError, KeyError):
    """The key does not exist (also a ``KeyError``)."""

    def __str__(self):  # KeyError would quote the message
        return KvfsError.__str__(self)


class AlreadyExistsError(KvfsError):
    """The key exists and the call was asked to report it."""


class NoSpaceError(KvfsError):
    """The pool (or the staging bound) has no room now: back-pressure, retry later."""


class LeasedError(KvfsError):
    """A read lease protects the object (remove without ``force``)."""


class PinnedError(KvfsError):
    """A hard pin protects the object (remove without ``force``)."""


class InvalidArgumentError(KvfsError, ValueError):
    """A bad key, size, option or buffer (also a ``ValueError``)."""


class NotRegisteredError(InvalidArgumentError):
    """Memory named by a zero-copy call is not registered (call ``Client.register``)."""


class BufferTooSmallError(InvalidArgumentError):
    """The destination is smaller than the object."""


class PutInProgressError(KvfsError):
    """Another writer's put of the key did not finish within the retry budget."""


class UnavailableError(KvfsError):
    """The master cannot be reached or is recovering."""


class TransferError(KvfsError):
    """Moving the bytes failed on every replica."""


class CorruptError(KvfsError):
    """A checksum did not match the bytes read."""


class TimeoutError(KvfsError, builtins.TimeoutError):
    """The call did not finish within the client's ``timeout_ms``."""


class NotConnectedError(KvfsError):
    """The client was closed (or the store never set up)."""


_BY_KIND = {
    "not_found": NotFoundError,
    "already_exists": AlreadyExistsError,
    "no_space": NoSpaceError,
    "leased": LeasedError,
    "pinned": PinnedError,
    "invalid_key": InvalidArgumentError,
    "invalid_argument": InvalidArgumentError,
    "too_large": InvalidArgumentError,
    "buffer_too_small": BufferTooSmallError,
    "not_registered": NotRegisteredError,
    "put_in_progress": PutInProgressError,
    "recovering": UnavailableError,
    "unavailable": UnavailableError,
    "transfer": TransferError,
    "corrupt": CorruptError,
    "version": KvfsError,
    "internal": KvfsError,
    "timeout": TimeoutError,
    "not_connected": NotConnectedError,
}


def make(kind, message, code, retryable):
    """Builds the exception for a failure of ``kind`` (called by the native module)."""
    return _BY_KIND.get(kind, KvfsError)(message, kind, code, retryable)
