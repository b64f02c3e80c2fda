"""From a job and its processed images and videos to the `EngineRequest` the engine runs (pure
logic).

    check_job(job, ...)               the cheap checks, before any image or video work
    render_request(job, items, p, v)  expand placeholders, place each item, check the length

A job's items are its images, then its videos (`MMJob.images`, `MMJob.videos`); in the request
they are in prompt order, as the engine takes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mmlane.model import ImageItem, Preprocessor
from mmlane.model.loading import expand_placeholder
from mmlane.model.video import VideoItem, VideoPreprocessor
from mmlane.protocol.errors import MMLaneError, RequestError
from mmlane.protocol.messages import EngineRequest, MMItem, MMJob


@dataclass(frozen=True)
class PreparedItem:
    """An image or a video ready to place: its tensors, or none when the engine takes them from
    its cache (or from an earlier item of the same request with the same hash)."""

    mm_hash: str
    num_tokens: int
    nbytes: int
    tensors: dict[str, np.ndarray]
    token_ids: tuple[int, ...] = ()
    """Its span where it is not its placeholder `num_tokens` times (ImageItem.token_ids,
    VideoItem.token_ids)."""

    @classmethod
    def processed(cls, mm_hash: str, item: ImageItem | VideoItem) -> PreparedItem:
        return cls(mm_hash, item.num_tokens, item.nbytes, item.tensors, item.token_ids)

    def by_hash(self) -> PreparedItem:
        """The same item sent as its hash alone."""
        return PreparedItem(self.mm_hash, self.num_tokens, self.nbytes, {}, self.token_ids)

    def expansion(self, placeholder: int) -> list[int] | tuple[int, ...]:
        """Its span: `token_ids`, else its placeholder token `num_tokens` times."""
        return self.token_ids or [placeholder] * self.num_tokens


def check_job(job: MMJob, *, image_token_id: int, video_token_id: int | None,
              max_context: int) -> None:
    """Refuse a job whose placeholders do not match its images and videos, or already too
    long. `video_token_id` None: the model takes no video."""
    placeholders = job.prompt_token_ids.count(image_token_id)
    if placeholders != len(job.images):
        raise RequestError(
            f"prompt has {_count(placeholders, 'image placeholder token')} but the job carries "
            f"{_count(len(job.images), 'image')}",
            code="invalid_request",
        )
    videos = 0 if video_token_id is None else job.prompt_token_ids.count(video_token_id)
    if videos != len(job.videos):
        raise RequestError(
            f"prompt has {_count(videos, 'video placeholder token')} but the job carries "
            f"{_count(len(job.videos), 'video')}",
            code="invalid_request",
        )
    if len(job.prompt_token_ids) > max_context:
        raise _too_long(len(job.prompt_token_ids), max_context, "before expanding its images")


def render_request(job: MMJob, items: list[PreparedItem], model: Preprocessor,
                   video: VideoPreprocessor | None) -> EngineRequest:
    """The job's prompt with each placeholder expanded, and each item (its images, then its
    videos) placed at its tokens. `video`: the model's video processing (None: no video)."""
    images, videos = items[: len(job.images)], items[len(job.images):]
    video_token_id = None if video is None else video.video_token_id
    prompt = job.prompt_token_ids
    if video is not None and video.text_joins_prompt and videos:
        merged, spans = model.merge_text_edges(
            prompt, video.video_token_id,
            [item.expansion(video.video_token_id) for item in videos])
        if merged is not prompt:
            prompt = merged
            videos = [replace(item, num_tokens=len(span), token_ids=tuple(span))
                      for item, span in zip(videos, spans, strict=True)]
    placeholders = prompt
    prompt = model.expand_placeholders(placeholders, [
        ImageItem(image.tensors, image.num_tokens, image.token_ids) for image in images])
    if video_token_id is not None:
        prompt = expand_placeholder(prompt, video_token_id,
                                    [item.expansion(video_token_id) for item in videos], "video")
    if len(prompt) > model.max_context:
        raise _too_long(len(prompt), model.max_context, _after_expanding(len(images), len(videos)))
    kinds = {model.image_token_id: images}
    if video_token_id is not None:
        kinds[video_token_id] = videos
    offsets = placeholder_offsets(placeholders, {
        placeholder: [item.num_tokens for item in kind] for placeholder, kind in kinds.items()})
    placed = [(offset, kinds[placeholder][index], placeholder)
              for offset, placeholder, index in offsets]
    _check_expansion(prompt, placed)
    mm_items = [
        MMItem(
            offset=offset, length=item.num_tokens, tensors=item.tensors,
            mm_hash=item.mm_hash, nbytes=item.nbytes,
        )
        for offset, item, _ in placed
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


def placeholder_offsets(
    token_ids: list[int], lengths: Mapping[int, Sequence[int]],
) -> list[tuple[int, int, int]]:
    """(offset once expanded, placeholder, index among that placeholder's items) of each
    placeholder token `lengths` names, in prompt order, when the i-th of placeholder `p`
    becomes lengths[p][i] tokens."""
    seen = dict.fromkeys(lengths, 0)
    placed, shift = [], 0
    for position, token in enumerate(token_ids):
        if token in seen:
            index = seen[token]
            seen[token] += 1
            placed.append((position + shift, token, index))
            shift += lengths[token][index] - 1
    return placed


def _check_expansion(prompt: list[int], placed: list[tuple[int, PreparedItem, int]]) -> None:
    # The model package owns expansion; a mismatch here is a bug there, not the request's fault.
    for offset, item, placeholder in placed:
        if prompt[offset:offset + item.num_tokens] != list(item.expansion(placeholder)):
            raise MMLaneError(
                f"placeholder expansion does not put the item's {item.num_tokens} tokens "
                f"at {offset}",
                code="internal",
            )


def _after_expanding(images: int, videos: int) -> str:
    if videos:
        return f"after expanding {_count(images, 'image')} and {_count(videos, 'video')}"
    return f"after expanding {_count(images, 'image')}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _too_long(length: int, max_context: int, when: str) -> RequestError:
    return RequestError(
        f"prompt is {length} tokens {when}, more than the model's context of {max_context}",
        code="prompt_too_long",
    )
