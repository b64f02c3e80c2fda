"""The one exception tree of mmlane, its error codes, and how an error crosses a boundary.

    MMLaneError                      every error mmlane raises on purpose; unclassified: internal
    ├── RequestError                 the request's fault: reply with the message, keep serving
    │     │ codes: invalid_request, invalid_message, invalid_image, bad_image, media_not_allowed,
    │     │        fetch_failed, too_many_images, prompt_too_long, model_error, model_not_found,
    │     │        image_too_large, request_too_large, invalid_api_key, invalid_video,
    │     │        video_too_large
    │     └── TensorsRefused         a message's shared-memory tensors named no slot of its sender's
    ├── RetryableError               not the request's fault; the same request may succeed later
    │     │ codes: overloaded, peer_restarted, aborted, timeout, cache_miss, backend_died,
    │     │        backend_unavailable, tensors_lost, request_timeout, rate_limit_exceeded
    │     ├── CacheMissError         the engine lacks cached items a request refers to (`mm_hashes`)
    │     └── TensorsLost            a message's shared-memory tensors were gone (protocol/shm.py)
    ├── InternalError                our fault, in one request: it fails, the process serves on
    │     codes: internal
    └── FatalError                   the process cannot serve (bad config, model will not load)
          codes: bad_config, cannot_serve

`CODES` is the table behind this tree: each code's kind and the HTTP status it is answered with
(tests/test_protocol.py checks the tree against it, and every code services/ raises).
Errors cross sockets as data (`ErrorInfo`), never as pickled exceptions: `to_info()` on the way
out, `from_info()` on the way in. Foreign errors (PIL, msgspec, the tokenizer, torch) are
translated at the boundary (`translate(exc, where)`, or a `with translated(where):` block)
through one map, `FOREIGN_ERRORS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import msgspec


class Code(NamedTuple):
    """What an error code means to whoever handles the error."""

    kind: str
    """The kind of exception that carries it: request, retryable, internal or fatal."""
    http_status: int


CODES: dict[str, Code] = {
    "invalid_request": Code("request", 400),
    "invalid_message": Code("request", 400),  # undecodable or invalid msgpack on a socket
    "invalid_image": Code("request", 400),
    "bad_image": Code("request", 400),  # `mmlane chat` cannot read its image file
    "media_not_allowed": Code("request", 400),
    "fetch_failed": Code("request", 400),
    "too_many_images": Code("request", 400),
    "prompt_too_long": Code("request", 400),
    "model_error": Code("request", 400),  # the model failed on this request's inputs
    "model_not_found": Code("request", 404),
    "image_too_large": Code("request", 413),
    "request_too_large": Code("request", 413),
    "invalid_api_key": Code("request", 401),  # no key, or a wrong one, for the HTTP API
    "invalid_video": Code("request", 400),
    "video_too_large": Code("request", 413),  # over a bound of mm_worker/video.py's VideoLimits
    "request_timeout": Code("retryable", 408),  # an HTTP client too slow sending its request
    "rate_limit_exceeded": Code("retryable", 429),  # over the HTTP API's --http-rate-limit
    "overloaded": Code("retryable", 503),
    "peer_restarted": Code("retryable", 503),
    "aborted": Code("retryable", 503),
    "timeout": Code("retryable", 504),
    "cache_miss": Code("retryable", 503),
    "backend_died": Code("retryable", 503),  # the engine's backend (vLLM's core) died: restarting
    "backend_unavailable": Code("retryable", 503),  # a remote vLLM replica unreachable or failing
    "tensors_lost": Code("retryable", 503),  # shared-memory pixels gone (protocol/shm.py)
    "internal": Code("internal", 500),
    "bad_config": Code("fatal", 500),
    "cannot_serve": Code("fatal", 500),
}
"""Every error code, its kind and its HTTP status; a new code is added here first."""


class ErrorInfo(msgspec.Struct, array_like=True, frozen=True):
    """An error as it travels: the kind picks the exception class, the code names the problem."""

    kind: str
    code: str
    message: str
    mm_hashes: list[str] = []
    """For a cache miss: the hashes of the items to send again with their tensors."""


class MMLaneError(Exception):
    """Base of every error mmlane raises on purpose; raised as itself, it is an internal one."""

    kind = "internal"
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


class PartlyDecoded(MMLaneError):
    """A message decoded but for some of its shared-memory tensors: `decoded` is the message
    with those tensors empty, so that its sender can still be answered; `counter` counts it."""

    counter = ""

    def __init__(self, message: str, *, decoded: object) -> None:
        super().__init__(message)
        self.decoded = decoded


class TensorsLost(PartlyDecoded, RetryableError):
    """A message's shared-memory tensors were gone when it arrived (their sender restarted, or
    took the slots back)."""

    default_code = "tensors_lost"
    counter = "tensors_lost"


class TensorsRefused(PartlyDecoded, RequestError):
    """A message's shared-memory tensors named no slot, or a file that is no slot of its
    sender's, or one whose bytes disagree with the message (protocol/shm.py)."""

    default_code = "invalid_message"
    counter = "tensors_refused"


class InternalError(MMLaneError):
    """An unexpected fault of ours while serving one request: that request fails (HTTP 500),
    the process goes on serving the others."""


class FatalError(MMLaneError):
    """The process cannot go on serving (bad configuration, a model that does not load)."""

    kind = "fatal"
    default_code = "cannot_serve"


_KINDS: dict[str, type[MMLaneError]] = {
    cls.kind: cls for cls in (RequestError, RetryableError, InternalError, FatalError)
}


def from_info(info: ErrorInfo) -> MMLaneError:
    """Rebuild the exception an `ErrorInfo` describes (an unknown kind becomes internal)."""
    if info.kind == RetryableError.kind and info.code == CacheMissError.default_code:
        return CacheMissError(info.message, mm_hashes=list(info.mm_hashes))
    return _KINDS.get(info.kind, InternalError)(info.message, code=info.code)


def http_status(info: ErrorInfo) -> int:
    """The HTTP status an error is answered with: its code's, or, for a code missing from
    `CODES` (a newer peer's), that of its kind's default code."""
    code = CODES.get(info.code) or CODES[_KINDS.get(info.kind, InternalError).default_code]
    return code.http_status


class Foreign(NamedTuple):
    """What a foreign exception becomes: our code, and what the message says after `where`."""

    code: str
    problem: str = "{exc}"
    """A format string of `exc`, the foreign exception."""


FOREIGN_ERRORS: dict[str, Foreign] = {
    "PIL.UnidentifiedImageError": Foreign("invalid_image", "not an image in a format we can read"),
    "PIL.Image.DecompressionBombError": Foreign(
        "image_too_large", "more pixels than max_image_pixels allows ({exc})"
    ),
    "msgspec.DecodeError": Foreign("invalid_message"),  # ValidationError is one
    "zmq.error.Again": Foreign("overloaded", "its socket's queue is full"),
    "torch.OutOfMemoryError": Foreign("overloaded", "out of device memory: {exc}"),
    "builtins.MemoryError": Foreign("overloaded", "out of memory"),
}
"""Foreign exception types by `module.qualname` (looked up along the type's MRO, so the most
specific entry wins): named, not imported, so that protocol/ loads neither PIL nor torch."""


def translate(exc: BaseException, where: str, *, default: str = "internal") -> MMLaneError:
    """Our error for `exc`, caught at a boundary: "{where}: {problem}".

    Ours pass through unchanged. A type in `FOREIGN_ERRORS` takes its code; any other takes
    `default`: internal (a bug of ours), unless the boundary knows that whatever fails there is
    the input's fault (a decoder of hostile bytes says invalid_image).
    """
    if isinstance(exc, MMLaneError):
        return exc
    names = (f"{cls.__module__}.{cls.__qualname__}" for cls in type(exc).__mro__)
    code, problem = next((FOREIGN_ERRORS[n] for n in names if n in FOREIGN_ERRORS),
                         Foreign(default))
    return _KINDS[CODES[code].kind](f"{where}: {problem.format(exc=exc)}", code=code)


@contextmanager
def translated(where: str, *, default: str = "internal") -> Iterator[None]:
    """Raise what `translate` makes of any foreign exception the block raises, `from` it."""
    try:
        yield
    except MMLaneError:
        raise
    except Exception as exc:
        raise translate(exc, where, default=default) from exc
