"""Loading a model directory, and the preprocessing every role shares.

The tiny default model and any real Hugging Face model directory go through the same code.
Errors from transformers, jinja and PIL are translated here into ValueErrors that say what is
wrong in mmlane's terms:

    ValueError
    ├── ModelDirError          the model directory is missing or unusable (fatal at startup)
    ├── UnsupportedModelError  its model_type has no family (families.py; fatal at startup)
    ├── PromptError            the request's messages cannot become a prompt (the client's fault)
    └── ImageError             the image processor rejects an image (the client's fault)
"""

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import jinja2
import numpy as np
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)

from mmlane.common.config import ImageBackend
from mmlane.common.model_dir import ModelDirError, resolve_model_dir
from mmlane.model.families import (
    Family,
    Tensors,
    TokenCounter,
    UnsupportedModelError,
    family_for,
    processor_uint8,
)
from mmlane.model.pixels import PixelNorm

if TYPE_CHECKING:
    import torch

REFERENCE_IMAGE_BACKEND: ImageBackend = "pil"
"""What `load_preprocessor` renders images with unless told: PIL, transformers' reference, which
needs no torchvision. It is not the MM worker's `image_backend` setting ('auto' by default):
roles that render no image (the frontend, the engine) and the tests' references take it; a
role that renders images passes its setting."""


class PromptError(ValueError):
    """The messages cannot be rendered, or their placeholders do not match the images."""


class ImageError(ValueError):
    """The image processor rejected an image."""


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One processed image: the model's tensors for it and its placeholder's expansion."""

    tensors: dict[str, np.ndarray]
    num_tokens: int
    """The length of its span: all the tokens its placeholder becomes, image tokens or not."""
    token_ids: tuple[int, ...] = ()
    """The span itself where it is not the image token `num_tokens` times (a family with a
    `placeholder_text`: Mistral 3's row breaks, InternVL's <img> and </img>, Idefics3's tiles
    among row/column tokens)."""

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors.values())


@dataclass(frozen=True, eq=False)
class Preprocessor:
    """Everything between a chat request and the model's inputs; holds no model weights."""

    model_id: str
    family: Family
    tokenizer: PreTrainedTokenizerBase
    image_processor: Any
    chat_template: str
    image_token_id: int
    eos_token_ids: list[int]
    max_context: int
    count_image_tokens: TokenCounter
    """How many image tokens (image features) an image with these tensors has."""
    expand_image: Callable[[Tensors], tuple[int, ...]]
    """The ids that replace an image's placeholder (its span): its image tokens, with the
    family's other tokens around them where it has some (`Family.placeholder_text`)."""
    pixel_norm: PixelNorm
    """What the engine applies to an item's uint8 pixel_values (services/model/pixels.py)."""
    # Special tokens the tokenizer adds around a text when asked (e.g. Llama's BOS).
    special_prefix: list[int]
    special_suffix: list[int]
    image_backend: str
    """The image processor's backend: 'pil' or 'torchvision' (see `load_preprocessor`)."""

    def render_prompt(self, messages: list[dict], *, tools: list[dict] | None = None,
                      add_generation_prompt: bool = True) -> str:
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages,
                tools=cast("list[dict | Callable]", tools) if tools else None,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise PromptError(f"cannot apply the chat template of {self.model_id}: {exc}") from exc
        return cast(str, prompt)

    def tokenize_batch(self, prompts: list[str]) -> list[list[int]]:
        # The Rust batch call releases the GIL, so tokenizer threads run in parallel.
        encodings = self.tokenizer.backend_tokenizer.encode_batch_fast(
            prompts, add_special_tokens=False
        )
        return [
            self._add_special_tokens(prompt, encoding.ids)
            for prompt, encoding in zip(prompts, encodings, strict=True)
        ]

    def tokenize_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A plain text's token ids with the tokenizer's special tokens (unless told not to), as
        `tokenizer(text)` gives them (vLLM's /v1/completions default); no chat template."""
        [encoding] = self.tokenizer.backend_tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return encoding.ids

    def bound_word_cache(self, words: int) -> None:
        """Keep at most `words` words in each thread's word cache of the tokenizer's model (the
        tokenizers library's BPE and Unigram models have one, 10,000 words by default; it only
        fills, and a 256-character word costs 8 KB in it). Set it before tokenizing."""
        resize = getattr(self.tokenizer.backend_tokenizer.model, "_resize_cache", None)
        if resize is not None:  # WordPiece and WordLevel cache nothing
            resize(words)

    def _add_special_tokens(self, prompt: str, ids: list[int]) -> list[int]:
        # Same rule as the HF processor: add the tokenizer's special tokens unless the chat
        # template already wrote the BOS token itself.
        bos_token = self.tokenizer.bos_token
        if bos_token is not None and prompt.startswith(bos_token):
            return ids
        return self.special_prefix + ids + self.special_suffix

    def process_image(self, image: Image.Image) -> ImageItem:
        """The image's tensors, pixels as uint8 (`pixel_norm` turns them into the processor's
        float output)."""
        # The family's own uint8 path reproduces the PIL backend; any other backend is run
        # itself, with its rescale and normalise off, and its one-image batch split as any.
        try:
            if self.image_backend == "pil":
                batch = self.family.uint8_pixels(self.image_processor, image)
            else:  # torchvision
                [batch] = self.family.split_items(self.image_processor, processor_uint8(
                    self.image_processor, _torchvision_input(image), **self.family.one_frame()))
        except (ValueError, OSError) as exc:
            raise ImageError(f"cannot process a {image.width}x{image.height} image: {exc}") from exc
        tensors = {field: batch[field] for field in self.family.item_fields}
        token_ids = self.expand_image(tensors)
        structured = self.family.placeholder_text is not None
        return ImageItem(tensors, len(token_ids), token_ids if structured else ())

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the image processor resizes an upright image of this size to;
        raises ValueError for a size it refuses."""
        return self.family.resized_size(self.image_processor, width, height)

    def expand_placeholders(self, token_ids: list[int], items: list[ImageItem]) -> list[int]:
        """Replace the i-th image placeholder with items[i]'s expansion."""
        spans = [item.token_ids or (self.image_token_id,) * item.num_tokens for item in items]
        return expand_placeholder(token_ids, self.image_token_id, spans, "image")

    def merge_text_edges(self, token_ids: list[int], placeholder: int,
                         spans: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
        """Where a span (the i-th `placeholder`'s expansion) begins or ends with text, not an
        added token (SmolVLM's video: its words before the first frame and after the last),
        that text belongs with the prompt's text around the placeholder: the processor
        tokenizes the prompt with the span's text in it, and added tokens alone split what it
        tokenizes. Returns the prompt with each such run of text tokenized together (the
        placeholders kept) and the spans without their text edges; the prompt as it is where
        no span has any."""
        added = self._added_token_ids
        edges = []
        for span in spans:
            marks = [at for at, token in enumerate(span) if token in added]
            first, last = (marks[0], marks[-1] + 1) if marks else (0, len(span))
            edges.append((list(span[:first]), list(span[first:last]), list(span[last:])))
        if not any(lead or tail for lead, _, tail in edges):
            return token_ids, [core for _, core, _ in edges]
        backend = self.tokenizer.backend_tokenizer
        merged: list[int] = []
        text: list[int] = []  # the run of text tokens since the last added token
        before = ""  # the text the previous placeholder's span ends with

        def flush(after: str = "") -> None:
            nonlocal before
            if before or after:
                joined = before + backend.decode(text, skip_special_tokens=False) + after
                merged.extend(backend.encode(joined, add_special_tokens=False).ids)
            else:
                merged.extend(text)
            text.clear()
            before = ""

        next_edges = iter(edges)
        for token in token_ids:
            if token not in added:
                text.append(token)
            elif token == placeholder:
                lead, _, tail = next(next_edges)
                flush(backend.decode(lead, skip_special_tokens=False))
                merged.append(token)
                before = backend.decode(tail, skip_special_tokens=False)
            else:
                flush()
                merged.append(token)
        flush()
        return merged, [core for _, core, _ in edges]

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        """The ids the tokenizer splits text at before tokenizing it (special or not)."""
        return frozenset(self.tokenizer.backend_tokenizer.get_added_tokens_decoder())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self.tokenizer.decode(token_ids,
                                               skip_special_tokens=skip_special_tokens))


def expand_placeholder(token_ids: list[int], placeholder: int, spans: Sequence[Sequence[int]],
                       noun: str) -> list[int]:
    """`token_ids` with the i-th `placeholder` replaced by spans[i]; PromptError where the
    prompt has another number of them (`noun` names what they stand for: image, video)."""
    placeholders = token_ids.count(placeholder)
    if placeholders != len(spans):
        raise PromptError(
            f"the prompt has {placeholders} {noun} placeholders "
            f"but the request has {len(spans)} {noun}s"
        )
    expanded: list[int] = []
    next_spans = iter(spans)
    for token in token_ids:
        if token == placeholder:
            expanded.extend(next(next_spans))
        else:
            expanded.append(token)
    return expanded


def load_preprocessor(
    model_dir: str | Path, image_backend: ImageBackend = REFERENCE_IMAGE_BACKEND
) -> Preprocessor:
    model_dir = resolve_model_dir(model_dir)
    family, config = _load_config(model_dir)
    tokenizer = _load_tokenizer(model_dir)
    backend = _pick_image_backend(image_backend)
    image_processor = _load_image_processor(
        model_dir, backend, family.image_processor_settings(model_dir, config)
    )
    special_prefix, special_suffix = _added_special_ids(tokenizer)
    image_token_id = _image_token_id(model_dir, tokenizer, family)
    count_image_tokens = family.token_counter(model_dir, config, image_processor)
    return Preprocessor(
        model_id=model_dir.name,
        family=family,
        tokenizer=tokenizer,
        image_processor=image_processor,
        chat_template=_read_chat_template(model_dir, tokenizer),
        image_token_id=image_token_id,
        eos_token_ids=_eos_token_ids(model_dir, config, tokenizer),
        max_context=_max_context(model_dir, config),
        count_image_tokens=count_image_tokens,
        expand_image=_image_expansion(
            family, model_dir, config, image_processor, tokenizer, image_token_id,
            count_image_tokens,
        ),
        pixel_norm=PixelNorm.of(image_processor, family.frames(image_processor)),
        special_prefix=special_prefix,
        special_suffix=special_suffix,
        image_backend=backend,
    )


def _image_expansion(
    family: Family, model_dir: Path, config: Any, image_processor: Any,
    tokenizer: PreTrainedTokenizerBase, image_token_id: int, count_image_tokens: TokenCounter,
) -> Callable[[Tensors], tuple[int, ...]]:
    if family.placeholder_text is None:
        return lambda tensors: (image_token_id,) * count_image_tokens(tensors)
    placeholder_text = family.placeholder_text(model_dir, config, image_processor)
    backend = tokenizer.backend_tokenizer

    # The text begins and ends with special tokens, which split a prompt's text before the
    # tokenizer's model sees it: tokenized alone, it gives the ids it gives inside a prompt.
    # A family has a few distinct texts (one per tile grid), each tokenized once.
    @lru_cache(maxsize=64)
    def tokenized(text: str) -> tuple[int, ...]:
        return tuple(backend.encode(text, add_special_tokens=False).ids)

    return lambda tensors: tokenized(placeholder_text(tensors))


def load_model(model_dir: str | Path, device: str) -> "torch.nn.Module":
    # torch here, not above: the frontend loads this module without it (services/cli.py).
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = resolve_model_dir(model_dir)
    _load_config(model_dir)  # refuse unsupported families before loading weights
    # CPUs run float32 well and half precision poorly; accelerators keep the checkpoint's dtype.
    dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
    try:
        model: torch.nn.Module = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"cannot load model weights from {model_dir}: {exc}") from exc
    return model.to(device).eval()


def _load_config(model_dir: Path) -> tuple[Family, Any]:
    # Resolve the family from the raw file first, so an unknown model_type gets our message
    # rather than AutoConfig's.
    raw = read_json(model_dir / "config.json")
    model_type = raw.get("model_type")
    if model_type is None:
        raise ModelDirError(f"{model_dir / 'config.json'} has no model_type")
    try:
        family = family_for(model_type)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{model_dir}: {exc}") from None
    return family, AutoConfig.from_pretrained(model_dir)


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ModelDirError(f"{model_dir} needs a fast tokenizer (tokenizer.json)")
    return tokenizer


def _torchvision_input(image: Image.Image) -> "Image.Image | torch.Tensor":
    """An RGB image as the tensor a torchvision backend's processor makes of it
    (`pil_to_tensor`: the image's bytes, channel-first over a channel-last buffer) less that
    conversion's second copy of a full-size image; the same values and strides, so the same
    resize. Any other image as it is: the processor converts it to RGB its own way."""
    if image.mode != "RGB":
        return image
    import torch  # a role that renders images: the frontend loads this module without torch

    with warnings.catch_warnings():  # read, never written
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        pixels = torch.from_numpy(np.asarray(image))
    return pixels.permute(2, 0, 1)


def _pick_image_backend(setting: ImageBackend) -> str:
    if setting != "auto":
        return setting
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        return "pil"
    return "torchvision"


def _load_image_processor(model_dir: Path, backend: str, settings: dict[str, Any]) -> Any:
    try:
        return AutoImageProcessor.from_pretrained(model_dir, backend=backend, **settings)
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"cannot load the image processor in {model_dir}: {exc}") from exc


def _read_chat_template(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> str:
    # Same precedence as AutoProcessor: the processor's template files, then the tokenizer's.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        return read_json(json_file)["chat_template"]
    if isinstance(tokenizer.chat_template, str):
        return tokenizer.chat_template
    raise ModelDirError(f"{model_dir} has no chat template")


def _image_token_id(model_dir: Path, tokenizer: PreTrainedTokenizerBase, family: Family) -> int:
    token_id = tokenizer.backend_tokenizer.token_to_id(family.image_token)
    if token_id is None:
        raise ModelDirError(
            f"the tokenizer in {model_dir} lacks the image token {family.image_token!r}"
        )
    return token_id


def _eos_token_ids(model_dir: Path, config: Any, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    # generation_config.json is what HF generate() stops on; it often lists several ids.
    eos: Any = None
    if (model_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if eos is None:
        eos = getattr(config.get_text_config(), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return list(dict.fromkeys(token_id for token_id in ids if token_id is not None))


def _max_context(model_dir: Path, config: Any) -> int:
    max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if max_positions is None:
        raise ModelDirError(f"{model_dir / 'config.json'} has no max_position_embeddings")
    return max_positions


def _added_special_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a single text."""
    backend = tokenizer.backend_tokenizer
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    start = next(index for index in range(len(full)) if full[index : index + len(plain)] == plain)
    return full[:start], full[start + len(plain) :]


def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON file; ModelDirError where it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"cannot read {path}: {exc}") from exc
