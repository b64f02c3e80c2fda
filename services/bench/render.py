"""From a chat request to the `EngineRequest` the engine runs, in one process (pure logic).

The in-process server (`shared`, `split`) and the engine calibration build requests with these,
through `services.model` like mmlane's frontend and MM worker, so the engine gets the same prompt
and tensors in every mode.
"""

from __future__ import annotations

from protocol.messages import ChatMessage, EngineRequest, ImagePart, MMItem, SamplingParams
from services.model import ImageItem, Preprocessor


def template_messages(messages: list[ChatMessage]) -> tuple[list[dict], list[str]]:
    """The chat template's messages (an image part becomes `{"type": "image"}`) and the image
    URLs in order."""
    urls: list[str] = []
    rendered = []
    for message in messages:
        content: str | list[dict]
        if isinstance(message.content, str):
            content = message.content
        else:
            content = []
            for part in message.content:
                if isinstance(part, ImagePart):
                    urls.append(part.image_url.url)
                    content.append({"type": "image"})
                else:
                    content.append({"type": "text", "text": part.text})
        rendered.append({"role": message.role, "content": content})
    return rendered, urls


def engine_request(
    pre: Preprocessor, request_id: str, reply_to: str, token_ids: list[int],
    items: list[ImageItem], sampling: SamplingParams,
) -> EngineRequest:
    """Expand each image placeholder to its tokens and place each image's tensors there."""
    prompt = pre.expand_placeholders(token_ids, items)
    positions = [i for i, token in enumerate(token_ids) if token == pre.image_token_id]
    mm_items, shift = [], 0
    for position, item in zip(positions, items, strict=True):
        mm_items.append(MMItem(offset=position + shift, length=item.num_tokens,
                               tensors=item.tensors))
        shift += item.num_tokens - 1
    return EngineRequest(
        request_id=request_id, reply_to=reply_to, prompt_token_ids=prompt, sampling=sampling,
        mm_items=mm_items,
    )
