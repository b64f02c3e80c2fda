"""Checking a request before the model sees it; every failure names the bad field.

A video item (`MMItem.is_video`) is checked by `ModelSpec.video` (a spec without one refuses
it), an image by the family's checks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mmlane.engine.runner import ModelSpec
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import EngineRequest, MMItem
from mmlane.protocol.sampling import check_sampling

MAX_MM_HASH_CHARS = 128


def validate_request(request: EngineRequest, spec: ModelSpec) -> None:
    """Raise RequestError unless `request` can run on the model `spec` describes."""
    if math.isnan(request.deadline):  # in the engine's heap of deadlines it would block expiry
        raise RequestError("deadline must be a time (time.time(); 0: none), got nan")
    check_sampling(request.sampling, vocab_size=spec.vocab_size, prefix="sampling.")
    prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
    check_prompt(prompt, request.sampling.max_tokens, spec)
    check_item_spans(request.mm_items, len(prompt))
    check_item_tensors(request.mm_items, spec)
    check_image_tokens(prompt, request.mm_items, spec)
    check_item_cache_fields(request.mm_items)


def check_prompt(prompt: np.ndarray, max_tokens: int, spec: ModelSpec) -> None:
    if len(prompt) == 0:
        raise RequestError("prompt_token_ids is empty")
    if len(prompt) + max_tokens > spec.max_context:
        raise RequestError(
            f"prompt_token_ids ({len(prompt)} tokens) + sampling.max_tokens ({max_tokens}) "
            f"exceeds the model's context of {spec.max_context} tokens",
            code="prompt_too_long",
        )
    # An id outside the embedding table would fail inside the model (on CUDA: a device assert
    # that poisons the whole process), so it is refused here.
    outside = np.flatnonzero((prompt < 0) | (prompt >= spec.vocab_size))
    if len(outside):
        index = int(outside[0])
        raise RequestError(
            f"prompt_token_ids[{index}] = {int(prompt[index])} is outside the vocabulary "
            f"(0..{spec.vocab_size - 1})"
        )


def check_item_spans(items: list[MMItem], prompt_len: int) -> None:
    end = 0
    for index, item in enumerate(items):
        where = f"mm_items[{index}]"
        if item.length < 1:
            raise RequestError(f"{where}.length must be >= 1, got {item.length}")
        if item.offset < end:
            raise RequestError(
                f"{where}.offset {item.offset} overlaps or precedes the previous item "
                f"(which ends at {end})"
            )
        end = item.offset + item.length
        if end > prompt_len:
            raise RequestError(
                f"{where} covers tokens {item.offset}..{end - 1}, beyond the prompt's {prompt_len}"
            )


def check_image_tokens(prompt: np.ndarray, items: list[MMItem], spec: ModelSpec) -> None:
    """Each item's span must be its image's or video's expansion (from its checked tensors),
    and the prompt's image and video tokens must be the items' features, none outside the
    spans."""
    tokens = {"image": spec.image_token_id}
    if spec.video is not None:
        tokens["video"] = spec.video.video_token_id
    covered = dict.fromkeys(tokens.values(), 0)  # by token: a SmolVLM video's are image tokens
    for index, item in enumerate(items):
        kind = "video" if item.is_video else "image"
        expected = np.asarray(_expansion(item, spec), dtype=np.int64)
        if item.length != len(expected):
            raise RequestError(
                f"mm_items[{index}].length is {item.length} but its tensors make "
                f"{len(expected)} tokens"
            )
        if not np.array_equal(prompt[item.offset : item.offset + item.length], expected):
            raise RequestError(
                f"mm_items[{index}] covers tokens that are not its {kind}'s span: not the "
                f"{spec.family} expansion of its tensors"
            )
        if spec.video is not None and item.is_video:
            feature = spec.video.feature_token_id
            covered[feature] += int((expected == feature).sum())
        else:
            covered[spec.image_token_id] += spec.count_image_tokens(item.tensors)
    for kind, token in tokens.items():
        positions = int((prompt == token).sum())
        if positions != covered[token]:
            raise RequestError(f"prompt_token_ids has {positions} {kind}-token positions but "
                               f"mm_items cover {covered[token]}")


def _expansion(item: MMItem, spec: ModelSpec) -> Sequence[int]:
    if spec.video is not None and item.is_video:
        return spec.video.expand_item(item.tensors)
    return tuple(spec.expand_image(item.tensors))


def check_item_cache_fields(items: list[MMItem]) -> None:
    """After the receiver cache gave hash-only items their tensors: sizes must be what the
    sender cache counted, or the two caches would account differently."""
    for index, item in enumerate(items):
        if len(item.mm_hash) > MAX_MM_HASH_CHARS:
            raise RequestError(
                f"mm_items[{index}].mm_hash is {len(item.mm_hash)} characters, "
                f"at most {MAX_MM_HASH_CHARS} allowed"
            )
        actual = sum(array.nbytes for array in item.tensors.values())
        if item.mm_hash and item.nbytes != actual:
            raise RequestError(
                f"mm_items[{index}].nbytes is {item.nbytes} but its tensors hold {actual} bytes"
            )


def check_item_tensors(items: list[MMItem], spec: ModelSpec) -> None:
    images = []
    for index, item in enumerate(items):
        where = f"mm_items[{index}]"
        if not item.is_video:
            _check_names(where, item, spec.image_fields, f"a {spec.family} image")
            images.append(item)
        elif spec.video is None:
            raise RequestError(f"{where} is a video; this engine ({spec.family} family, or its "
                               "backend) takes no video")
        else:
            _check_names(where, item, spec.video.item_fields, f"a {spec.model_id} video")
            spec.video.check_item(where, item.tensors)
            if spec.video.runs_apart:
                _check_apart(items, index)
    spec.check_items(images)


def _check_names(where: str, item: MMItem, fields: tuple[str, ...], what: str) -> None:
    if set(item.tensors) != set(fields):
        raise RequestError(f"{where}.tensors has {sorted(item.tensors)}, {what} needs "
                           f"{sorted(fields)}")


def _check_apart(items: list[MMItem], index: int) -> None:
    """M-RoPE finds videos as runs of video tokens: two touching videos would merge."""
    before = items[index - 1] if index else None
    if before is not None and before.is_video and \
            items[index].offset == before.offset + before.length:
        raise RequestError(f"mm_items[{index}] starts right where mm_items[{index - 1}] ends; "
                           "Qwen2-VL needs a token (e.g. <|vision_end|>) between two videos")
