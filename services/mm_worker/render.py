"""From a job and its processed images to the `EngineRequest` the engine runs (pure logic).

    check_job(job, ...)            the cheap checks, before any image work
    render_request(job, images, p) expand placeholders, place each image, check the length
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmlane.model import ImageItem, Preprocessor
from mmlane.protocol.errors import MMLaneError, RequestError
from mmlane.protocol.messages import EngineRequest, MMItem, MMJob


@dataclass(frozen=True)
class PreparedImage:
    """An image ready to place: its tensors, or none when the engine takes them from its cache
    (or from an earlier image of the same request with the same hash)."""

    mm_hash: str
    num_tokens: int
    nbytes: int
    tensors: dict[str, np.ndarray]
    token_ids: tuple[int, ...] = ()
    """Its span where it is not the image token `num_tokens` times (ImageItem.token_ids)."""

    @classmethod
    def processed(cls, mm_hash: str, item: ImageItem) -> PreparedImage:
        return cls(mm_hash, item.num_tokens, item.nbytes, item.tensors, item.token_ids)

    def by_hash(self) -> PreparedImage:
        """The same image sent as its hash alone."""
        return PreparedImage(self.mm_hash, self.num_tokens, self.nbytes, {}, self.token_ids)

    def expansion(self, image_token_id: int) -> list[int] | tuple[int, ...]:
        return self.token_ids or [image_token_id] * self.num_tokens


def check_job(job: MMJob, *, image_token_id: int, max_context: int) -> None:
    """Refuse a job whose placeholders do not match its images, or already too long."""
    placeholders = job.prompt_token_ids.count(image_token_id)
    if placeholders != len(job.images):
        raise RequestError(
            f"prompt has {_count(placeholders, 'image placeholder token')} but the job carries "
            f"{_count(len(job.images), 'image')}",
            code="invalid_request",
        )
    if len(job.prompt_token_ids) > max_context:
        raise _too_long(len(job.prompt_token_ids), max_context, "before expanding its images")


def render_request(
    job: MMJob, images: list[PreparedImage], model: Preprocessor
) -> EngineRequest:
    """The job's prompt with each placeholder expanded, and each image placed at its tokens."""
    items = [ImageItem(image.tensors, image.num_tokens, image.token_ids) for image in images]
    prompt = model.expand_placeholders(job.prompt_token_ids, items)
    if len(prompt) > model.max_context:
        raise _too_long(len(prompt), model.max_context, _after_expanding(len(items)))
    lengths = [image.num_tokens for image in images]
    offsets = placeholder_offsets(job.prompt_token_ids, model.image_token_id, lengths)
    _check_expansion(prompt, offsets, images, model.image_token_id)
    mm_items = [
        MMItem(
            offset=offset, length=image.num_tokens, tensors=image.tensors,
            mm_hash=image.mm_hash, nbytes=image.nbytes,
        )
        for offset, image in zip(offsets, images, strict=True)
    ]
    return EngineRequest(
        request_id=job.request_id,
        reply_to=job.reply_to,
        prompt_token_ids=prompt,
        sampling=job.sampling,
        mm_items=mm_items,
        deadline=job.deadline,
        render=job.render,
    )


def placeholder_offsets(token_ids: list[int], placeholder: int, lengths: list[int]) -> list[int]:
    """Where each image's first token lands once the i-th placeholder becomes lengths[i] tokens."""
    positions = [i for i, token in enumerate(token_ids) if token == placeholder]
    offsets, shift = [], 0
    for position, length in zip(positions, lengths, strict=True):
        offsets.append(position + shift)
        shift += length - 1
    return offsets


def _check_expansion(
    prompt: list[int], offsets: list[int], images: list[PreparedImage], placeholder: int
) -> None:
    # The model package owns expansion; a mismatch here is a bug there, not the request's fault.
    for offset, image in zip(offsets, images, strict=True):
        if prompt[offset:offset + image.num_tokens] != list(image.expansion(placeholder)):
            raise MMLaneError(
                f"placeholder expansion does not put the image's {image.num_tokens} tokens "
                f"at {offset}",
                code="internal",
            )


def _after_expanding(images: int) -> str:
    return f"after expanding {_count(images, 'image')}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _too_long(length: int, max_context: int, when: str) -> RequestError:
    return RequestError(
        f"prompt is {length} tokens {when}, more than the model's context of {max_context}",
        code="prompt_too_long",
    )
