"""Check a client's chat request and turn it into what the chat template and the MM worker need."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import RequestError
from protocol.messages import ChatRequest, ImagePart, ImageUrl, SamplingParams, TextPart


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed validation: template messages, its images in order, sampling."""

    template_messages: list[dict]
    images: list[ImageUrl]
    sampling: SamplingParams


def check_request(request: ChatRequest, *, max_images: int) -> CheckedRequest:
    """Validate a chat request; raise RequestError naming the offending field."""
    if not request.messages:
        raise RequestError("messages: at least one message is required")
    sampling = _check_sampling(request)
    images: list[ImageUrl] = []
    template_messages = []
    for index, message in enumerate(request.messages):
        template_messages.append(
            {"role": message.role, "content": _content(message.content, images, index)}
        )
    if len(images) > max_images:
        raise RequestError(
            f"too many images: {len(images)} in the request, at most {max_images} allowed",
            code="too_many_images",
        )
    return CheckedRequest(template_messages, images, sampling)


def _content(content: str | list, images: list[ImageUrl], index: int) -> str | list[dict]:
    if isinstance(content, str):
        return content
    parts: list[dict] = []
    for part in content:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            if not part.image_url.url:
                raise RequestError(f"messages[{index}]: image_url.url is empty")
            images.append(part.image_url)
            parts.append({"type": "image"})
    return parts


def _check_sampling(request: ChatRequest) -> SamplingParams:
    if request.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}")
    if request.temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {request.temperature}")
    if not 0 < request.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {request.top_p}")
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
    )
