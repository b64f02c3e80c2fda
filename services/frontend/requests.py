"""Check a client's chat or completion request and turn it into what the MM worker and the
engine need. The two differ only in how their prompt token ids are made.

    check_request(request, ...)     validate; the prompt (template messages, or a completion's
                                    text or token ids), the images and videos, the sampling
    check_stop(stop, ...)           validate the stop strings (the frontend applies them)
    prompt_token_ids(pre, checked)  render the chat template and tokenize, or tokenize the text,
                                    or check the token ids (a pool thread's work)
    tokenize(pre, request, ...)     /tokenize's ids; detokenize(pre, ids) /detokenize's text

Pure functions: the frontend runs them, and so do the in-process designs the benchmark
(`python -m bench`) measures mmlane against, so every design tokenizes exactly as the frontend
does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from mmlane.model import Preprocessor
from mmlane.model.grammar import check_grammar
from mmlane.model.video import VIDEO_FAMILIES, VIDEO_MODELS, video_token_id
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ImagePart,
    ImageUrl,
    TextPart,
    VideoPart,
    VideoSampling,
)
from mmlane.protocol.sampling import SamplingParams, check_sampling, sampling_of


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed validation: its prompt, its images and videos in order,
    sampling."""

    template_messages: list[dict] | None
    """A chat's messages for the template; None for a completion, whose prompt is `prompt`."""
    images: list[ImageUrl]
    sampling: SamplingParams
    prompt: str | list[int] = ""
    """A completion's text (tokenized as it is) or token ids (taken as they are)."""
    tools: list[dict] = field(default_factory=list)
    """A chat's tools, for the template."""
    render: bool = False
    """Rendered only, not run (`RequestFields.render`)."""
    videos: list[ImageUrl] = field(default_factory=list)
    video_sampling: VideoSampling = VideoSampling()
    """How its videos are sampled (`ChatRequest.mm_processor_kwargs`)."""

    @property
    def has_media(self) -> bool:
        """Whether it goes through an MM worker: it has images or videos."""
        return bool(self.images or self.videos)

    @property
    def first_media(self) -> ImageUrl:
        """Its first image, else its first video: the MM worker's affinity key."""
        return (self.images or self.videos)[0]

    def shown_ids(self, token_ids: list[int], finish_reason: str | None,
                  eos_token_ids: Sequence[int]) -> list[int]:
        """The output tokens whose text the client sees: a token of `stop_token_ids`, or the
        model's end of sequence, that ends the output counts among its tokens but adds no text,
        as in vLLM (which shows when special tokens are not skipped)."""
        if finish_reason == "stop" and token_ids and (
                token_ids[-1] in self.sampling.stop_token_ids or token_ids[-1] in eos_token_ids):
            return token_ids[:-1]
        return token_ids


def check_request(request: ChatRequest | CompletionRequest, *,
                  max_images: int) -> CheckedRequest:
    """Validate a chat or completion request; raise RequestError naming the offending field."""
    if isinstance(request, CompletionRequest):
        return _check_completion(request)
    if not request.messages:
        raise RequestError("messages: at least one message is required")
    check_sampling(request)
    images: list[ImageUrl] = []
    videos: list[ImageUrl] = []
    template_messages = []
    for index, message in enumerate(request.messages):
        template_messages.append(
            {"role": message.role, "content": _content(message.content, images, videos, index),
             **_tool_fields(message, index)}
        )
    if len(images) + len(videos) > max_images:
        what = "images and videos" if videos else "images"
        raise RequestError(
            f"too many {what}: {len(images) + len(videos)} in the request, at most {max_images} "
            "allowed", code="too_many_images",
        )
    return CheckedRequest(template_messages, images, sampling_of(request), tools=request.tools,
                          render=request.render, videos=videos,
                          video_sampling=request.mm_processor_kwargs)


def _tool_fields(message: ChatMessage, index: int) -> dict:
    """A message's tool calls and tool call id, as chat templates take them: each call's
    arguments as a mapping, not JSON text (transformers' convention, as vLLM renders them)."""
    fields: dict = {}
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    calls = []
    for number, call in enumerate(message.tool_calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError as exc:
            raise RequestError(f"messages[{index}].tool_calls[{number}].function.arguments: "
                               f"not JSON: {exc}") from exc
        calls.append({"id": call.id, "type": call.type,
                      "function": {"name": call.function.name, "arguments": arguments}})
    if calls:
        fields["tool_calls"] = calls
    return fields


def check_stop(stop: list[str], *, max_strings: int, max_chars: int) -> None:
    """Refuse stop strings that are too many, too long or empty, naming `stop`: each one costs
    work on every output token, and an empty one would end every output at once."""
    if len(stop) > max_strings:
        raise RequestError(f"stop: at most {max_strings} stop strings, got {len(stop)}")
    for index, text in enumerate(stop):
        if not text:
            raise RequestError(f"stop: stop[{index}] is empty")
        if len(text) > max_chars:
            raise RequestError(f"stop: stop[{index}] has {len(text)} characters, at most "
                               f"{max_chars} allowed")


def _check_completion(request: CompletionRequest) -> CheckedRequest:
    if not request.prompt:
        raise RequestError("prompt: must not be empty")
    check_sampling(request)
    return CheckedRequest(None, [], sampling_of(request), request.prompt, render=request.render)


def _content(content: str | list, images: list[ImageUrl], videos: list[ImageUrl],
             index: int) -> str | list[dict]:
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
        elif isinstance(part, VideoPart):
            if not part.video_url.url:
                raise RequestError(f"messages[{index}]: video_url.url is empty")
            videos.append(part.video_url)
            parts.append({"type": "video"})
    return parts


def prompt_token_ids(pre: Preprocessor, checked: CheckedRequest) -> list[int]:
    """The prompt's token ids; raise RequestError for forged placeholders, ids outside the
    vocabulary, a text prompt too long for the model (an image prompt is checked once its
    images are expanded) or a structured-output constraint that cannot compile (before the
    engine spends work on it)."""
    if checked.sampling.structured_outputs is not None:
        check_grammar(checked.sampling.structured_outputs)
    video_token = video_token_id(pre)
    if checked.videos and video_token is None:
        raise RequestError(f"messages: this model ({pre.family.name} family) takes no video; "
                           f"mmlane renders videos for the {VIDEO_MODELS} families")
    token_ids = _token_ids(pre, checked)
    # Only the chat template may place placeholders; text and ids must not forge them.
    source = "messages: text" if checked.template_messages is not None else "prompt:"
    if token_ids.count(pre.image_token_id) != len(checked.images):
        raise RequestError(
            f"{source} contains the reserved image token {pre.family.image_token!r}",
        )
    if video_token is not None and token_ids.count(video_token) != len(checked.videos):
        raise RequestError(f"{source} contains the reserved video token "
                           f"{VIDEO_FAMILIES[pre.family.name].token!r}")
    prompt_tokens = len(token_ids)
    needed = prompt_tokens + checked.sampling.max_tokens
    if not checked.has_media and needed > pre.max_context:
        raise RequestError(
            f"prompt too long: {prompt_tokens} prompt tokens + max_tokens "
            f"{checked.sampling.max_tokens} exceed the model's context of "
            f"{pre.max_context} tokens",
            code="prompt_too_long",
        )
    return token_ids


def _token_ids(pre: Preprocessor, checked: CheckedRequest, *, add_generation_prompt: bool = True,
               add_special_tokens: bool = True) -> list[int]:
    if checked.template_messages is not None:
        prompt = pre.render_prompt(checked.template_messages, tools=checked.tools,
                                   add_generation_prompt=add_generation_prompt)
        return pre.tokenize_batch([prompt])[0]
    if isinstance(checked.prompt, str):
        return pre.tokenize_text(checked.prompt, add_special_tokens=add_special_tokens)
    _check_token_ids(pre, checked.prompt, "prompt")
    return checked.prompt


def _check_token_ids(pre: Preprocessor, token_ids: list[int], field: str) -> None:
    """Refuse ids the tokenizer cannot decode (as vLLM), naming `field`."""
    top = len(pre.tokenizer) - 1
    outside = [token for token in token_ids if not 0 <= token <= top]
    if outside:
        raise RequestError(f"{field}: token id {outside[0]} is outside the vocabulary (0..{top})")


def tokenize(pre: Preprocessor, request: ChatRequest | CompletionRequest, *,
             add_generation_prompt: bool, add_special_tokens: bool) -> list[int]:
    """/tokenize's token ids: those the model gets for the request's prompt (a chat rendered
    with its template, with the generation prompt unless told not to; a text with the
    tokenizer's special tokens unless told not to). An image's tokens depend on its size, known
    only once it is processed, so a chat with images is refused."""
    checked = check_request(request, max_images=sys.maxsize)  # refused below, by name
    if checked.has_media:
        kind = "images" if checked.images else "videos"
        raise RequestError(f"messages: {kind} cannot be tokenized here: their tokens depend on "
                           "their size, known once the MM worker has processed them")
    return _token_ids(pre, checked, add_generation_prompt=add_generation_prompt,
                      add_special_tokens=add_special_tokens)


def detokenize(pre: Preprocessor, token_ids: list[int]) -> str:
    """/detokenize's text: the ids decoded together, special tokens included (vLLM's)."""
    _check_token_ids(pre, token_ids, "tokens")
    return cast(str, pre.tokenizer.decode(token_ids))
