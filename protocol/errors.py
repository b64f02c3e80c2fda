"""The one exception tree of mmlane, and how an error crosses a process boundary.

    MMLaneError                      every error mmlane raises on purpose
    ├── RequestError                 the request's fault: reply with the message, keep serving
    │     codes: invalid_request, invalid_image, media_not_allowed, too_many_images,
    │            image_too_large, prompt_too_long
    ├── RetryableError               not the request's fault; the same request may succeed later
    │     │ codes: overloaded, cache_miss, peer_restarted, timeout, aborted
    │     └── CacheMissError         the engine lacks cached items a request refers to (`mm_hashes`)
    └── FatalError                   the process cannot serve (bad config, model will not load)

Errors cross sockets as data (`ErrorInfo`), never as pickled exceptions: `to_info()` on the way
out, `from_info()` on the way in. Foreign errors (PIL, zmq, tokenizers, msgspec) are translated
at the boundary with `raise RequestError(...) from exc`.
"""

from __future__ import annotations

import msgspec


class ErrorInfo(msgspec.Struct, array_like=True, frozen=True):
    """An error as it travels: the kind picks the exception class, the code names the problem."""

    kind: str
    code: str
    message: str
    mm_hashes: list[str] = []
    """For a cache miss: the hashes of the items to send again with their tensors."""


class MMLaneError(Exception):
    """Base of every error mmlane raises on purpose."""

    kind = "fatal"
    default_code = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code
        self.message = message

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(kind=self.kind, code=self.code, message=self.message)


class RequestError(MMLaneError):
    """The request is malformed or not allowed; retrying it unchanged will fail again."""

    kind = "request"
    default_code = "invalid_request"


class RetryableError(MMLaneError):
    """A transient fault: overload, a cache miss, a restarted peer, a timeout."""

    kind = "retryable"
    default_code = "overloaded"


class CacheMissError(RetryableError):
    """The engine could not take these items from its receiver cache; resend them with tensors."""

    default_code = "cache_miss"

    def __init__(self, message: str, *, mm_hashes: list[str], code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.mm_hashes = mm_hashes

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(
            kind=self.kind, code=self.code, message=self.message, mm_hashes=self.mm_hashes
        )


class FatalError(MMLaneError):
    """The process cannot go on serving (bad configuration, a model that does not load)."""

    kind = "fatal"
    default_code = "internal"


_KINDS: dict[str, type[MMLaneError]] = {
    cls.kind: cls for cls in (RequestError, RetryableError, FatalError)
}


def from_info(info: ErrorInfo) -> MMLaneError:
    """Rebuild the exception an `ErrorInfo` describes (unknown kinds become fatal)."""
    if info.kind == RetryableError.kind and info.code == CacheMissError.default_code:
        return CacheMissError(info.message, mm_hashes=list(info.mm_hashes))
    return _KINDS.get(info.kind, FatalError)(info.message, code=info.code)
