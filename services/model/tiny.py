"""Offline, deterministic builder for tiny model directories.

A tiny model is a real Hugging Face model directory (tokenizer, image processor config, chat
template, config and safetensors weights) with a few MB of randomly initialised weights, so every
role can run end to end without a download. The same seed always gives byte-identical files.
Any change to the files built here bumps `BUILDER_VERSION` (services/common/model_dir.py).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralVisionConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
BPE_VOCAB_SIZE = 1500
MAX_POSITIONS = 4096

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

QWEN2_VL_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The chat template that Qwen2-VL-Instruct ships.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# llava-1.5-7b-hf's chat_template.json ("USER: <image>\n... ASSISTANT:"); unlike it, this also
# accepts plain-string content.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# llava-v1.6-mistral-7b-hf's chat_template.json: "[INST] <image>\n... [/INST]", images before
# the text, a system prompt as <<SYS>>; an assistant turn ends with '<\\s> ' as published (a
# backslash where '</s>' was meant); like LLAVA_CHAT_TEMPLATE it also accepts plain-string content.
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\n' + text + '\n<</SYS>>\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' }}"
    "{% if message['content'] is not string %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% endif %}"
    "{{ text + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + text + '<\\\\s> ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

# llava-onevision-qwen2-0.5b-ov-hf's chat_template.json: ChatML with the role, a space, the
# message's images, then its videos, then each text after a newline, and <|im_end|> with no
# newline after it; plain-string content too.
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ '\n' + message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Mistral-Small-3.1-Instruct's format: BOS, the system prompt, then [INST]...[/INST] turns with
# each image's [IMG] where its block stands (before or after the text); plain-string content
# too. Its default system prompt is shortened (the published one names today's date). Tools as
# vLLM's template for Mistral 3 with tools (examples/tool_chat_template_mistral3.jinja) writes
# them, which its `--tool-call-parser mistral` reads: the tools' JSON in [AVAILABLE_TOOLS] before
# the last user turn, an assistant's calls as `[TOOL_CALLS] [{"name", "arguments", "id"}]`, a
# tool's result in [TOOL_RESULTS] (ids are their last 9 characters, as Mistral's).
MISTRAL3_CHAT_TEMPLATE = (
    "{%- set default_system_message = 'You are Mistral Small 3, a Large Language Model (LLM) "
    "created by Mistral AI.' %}"
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}"
    "{%- set system_message = messages[0]['content'] %}"
    "{%- else %}{%- set system_message = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system_message = default_system_message %}{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}"
    "{%- set last_user = namespace(index=-1) %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{%- set last_user.index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools and loop.index0 == last_user.index %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if message['content'] is string %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST]' }}"
    "{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}"
    "{%- else %}"
    "{{- raise_exception('Only text and image blocks are supported in message content!') }}"
    "{%- endif %}{%- endfor %}{{- '[/INST]' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'system' %}"
    "{%- if message['content'] is string %}"
    "{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- else %}"
    "{{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '[TOOL_CALLS] [' }}{%- for call in message['tool_calls'] %}"
    "{{- (call['function'] | tojson)[:-1] + ', \"id\": \"' + call['id'][-9:] + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- message['content'][0]['text'] + eos_token }}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message['content'] | string + ', \"call_id\": \"'"
    " + message['tool_call_id'][-9:] + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}"
    "{{- raise_exception('Only user, system, assistant and tool roles are supported!') }}"
    "{%- endif %}{%- endfor %}"
)

# InternVL3-hf's ChatML (a Qwen2 language model): each image's <IMG_CONTEXT> and a newline
# where its block stands; plain-string content too.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
def _utterance_template(start: str) -> str:
    """Idefics3-8B-Llama3's and SmolVLM2's template ("User:<image>...<end_of_utterance>\n
    Assistant:"), after the `start` token each writes itself (a video part is SmolVLM2's
    `<video>`); like LLAVA_CHAT_TEMPLATE it also accepts plain-string content."""
    return (
        start + "{% for message in messages %}{{ message['role'] | capitalize }}"
        "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
        "{% else %}"
        "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
        "{% for line in message['content'] %}"
        "{% if line['type'] == 'text' %}{{ line['text'] }}"
        "{% elif line['type'] == 'image' %}{{ '<image>' }}"
        "{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
        "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    )


# Stock Qwen2-VL preprocessor_config.json, except max_pixels: the value Qwen documents for
# serving (1280 * 28 * 28), so a 12-megapixel photo becomes 1,280 tokens instead of 15,552 —
# which a few-MB model on a CPU can prefill, and which matches common deployments.
QWEN2_VL_IMAGE_PROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 1280 * 28 * 28,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}

# Stock LLaVA-1.5 preprocessor_config.json and processor_config.json.
LLAVA_IMAGE_PROCESSOR = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "image_processor_type": "CLIPImageProcessor",
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 336},
}
LLAVA_PROCESSOR = {
    "image_token": "<image>",
    "num_additional_image_tokens": 1,
    "patch_size": 14,
    "processor_class": "LlavaProcessor",
    "vision_feature_select_strategy": "default",
}

# Stock llava-hf/llava-v1.6-mistral-7b-hf preprocessor_config.json and processor_config.json:
# CLIP's 336-pixel crops, an "anyres" grid of up to 2x2 (or 1x3) tiles beside the whole image.
LLAVA_NEXT_GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
LLAVA_NEXT_IMAGE_PROCESSOR = {
    **LLAVA_IMAGE_PROCESSOR,
    "aspect_ratio_setting": "anyres",
    "do_pad": True,
    "image_grid_pinpoints": LLAVA_NEXT_GRID_PINPOINTS,
    "image_processor_type": "LlavaNextImageProcessor",
    "processor_class": "LlavaNextProcessor",
}
LLAVA_NEXT_PROCESSOR = {**LLAVA_PROCESSOR, "processor_class": "LlavaNextProcessor"}

# Stock llava-hf/llava-onevision-qwen2-0.5b-ov-hf preprocessor_config.json and
# processor_config.json: SigLIP's 384-pixel tiles (729 features each), a grid of up to 6x6 tiles
# whose features are pooled down to about 9 tiles' worth ("anyres_max_9").
LLAVA_ONEVISION_GRID_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
LLAVA_ONEVISION_IMAGE_PROCESSOR = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_grid_pinpoints": LLAVA_ONEVISION_GRID_PINPOINTS,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "LlavaOnevisionImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "LlavaOnevisionProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"height": 384, "width": 384},
}
LLAVA_ONEVISION_PROCESSOR = {
    "image_token": "<image>",
    "num_image_tokens": 729,
    "processor_class": "LlavaOnevisionProcessor",
    "video_token": "<video>",
    "vision_aspect_ratio": "anyres_max_9",
    "vision_feature_select_strategy": "full",
}


# Stock mistralai/Mistral-Small-3.1-24B-Instruct-2503 preprocessor_config.json and
# processor_config.json: Pixtral's resize of the longest edge to at most 1540 pixels, each side
# then rounded up to whole 28-pixel cells (patch 14 x spatial merge 2, which the processor
# passes to its image processor as the patch size); each cell is one [IMG] token, a row of
# them ends with [IMG_BREAK], the last row with [IMG_END].
MISTRAL3_IMAGE_PROCESSOR = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": CLIP_MEAN,
    "image_processor_type": "PixtralImageProcessor",
    "image_std": CLIP_STD,
    "patch_size": 14,
    "processor_class": "PixtralProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 1540},
}
MISTRAL3_PROCESSOR = {
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
    "image_token": "[IMG]",
    "patch_size": 14,
    "processor_class": "PixtralProcessor",
    "spatial_merge_size": 2,
}


# Stock OpenGVLab/InternVL3-1B-hf preprocessor_config.json and processor_config.json: GotOcr2's
# 448-pixel tiles (the processor turns crop_to_patches on: a grid of up to 12 tiles, and the
# whole image as a thumbnail beside them), 256 <IMG_CONTEXT> tokens a tile.
INTERNVL_IMAGE_PROCESSOR = {
    "crop_to_patches": False,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_processor_type": "GotOcr2ImageProcessor",
    "image_std": [0.229, 0.224, 0.225],
    "max_patches": 12,
    "min_patches": 1,
    "processor_class": "InternVLProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"height": 448, "width": 448},
}
INTERNVL_PROCESSOR = {"image_seq_length": 256, "processor_class": "InternVLProcessor"}
# Stock HuggingFaceM4/Idefics3-8B-Llama3 preprocessor_config.json and processor_config.json:
# the longest edge resized to 1456 (4 tiles), 364-pixel tiles (169 tokens each) beside the
# whole image, Lanczos, SigLIP's mean and std.
IDEFICS3_IMAGE_PROCESSOR = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 364},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 4 * 364},
}
IDEFICS3_PROCESSOR = {"image_seq_len": 169, "processor_class": "Idefics3Processor"}
# Stock HuggingFaceTB/SmolVLM-256M-Instruct preprocessor_config.json and processor_config.json,
# with the smolvlm classes and the video sampling of SmolVLM2-256M-Video-Instruct: the longest
# edge resized to 2048 (4 tiles), 512-pixel tiles (64 tokens each) beside the whole image; a
# video's frames at 1 fps, 64 at most, each one 512-pixel tile.
SMOLVLM_IMAGE_PROCESSOR = {
    **IDEFICS3_IMAGE_PROCESSOR,
    "image_processor_type": "SmolVLMImageProcessor",
    "max_image_size": {"longest_edge": 512},
    "processor_class": "SmolVLMProcessor",
    "size": {"longest_edge": 4 * 512},
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 512}},
}
SMOLVLM_PROCESSOR = {"image_seq_len": 64, "processor_class": "SmolVLMProcessor"}
IDEFICS3_MAX_POSITIONS = 32768
"""Room for a few images of up to 17 tiles (2,873 image tokens) each."""


def build_tiny_model(out_dir: Path, family: str = "qwen2_vl", seed: int = 0) -> Path:
    """Write a complete tiny model directory for `family` into `out_dir` and return it."""
    builder = _BUILDERS.get(family)
    if builder is None:
        raise ValueError(f"no tiny model for family {family!r}; choose one of {sorted(_BUILDERS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    builder(out_dir, seed)
    return out_dir


def _build_qwen2_vl(out_dir: Path, seed: int) -> None:
    _build_qwen_vl(out_dir, seed, Qwen2VLConfig, Qwen2VLForConditionalGeneration, {
        "embed_dim": 32,
        "hidden_size": 4 * QWEN_HEAD_DIM,
    }, processor_class="Qwen2VLProcessor")


def _build_qwen2_5_vl(out_dir: Path, seed: int) -> None:
    # Qwen2.5-VL's vision tower: RMSNorm, a gated MLP and windowed attention (the last block
    # attends to the whole image), projected to the language model's width.
    _build_qwen_vl(out_dir, seed, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, {
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 4 * QWEN_HEAD_DIM,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    }, processor_class="Qwen2_5_VLProcessor")


QWEN_HEAD_DIM = 64
"""The Qwen families' attention head size: one vLLM's CPU attention takes, so vLLM serves the
tiny models too."""


def _build_qwen_vl(
    out_dir: Path, seed: int, config_class: type[Qwen2VLConfig | Qwen2_5_VLConfig],
    model_class: type[PreTrainedModel], vision: dict, *, processor_class: str,
) -> None:
    """A tiny Qwen-VL model (Qwen2-VL, Qwen2.5-VL): the same tokenizer, template, image
    processor and language model; `vision` is the family's vision tower."""
    bpe = _train_bpe(QWEN2_VL_SPECIAL_TOKENS)
    _save_tokenizer(
        out_dir, bpe, QWEN2_VL_CHAT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    _write_json(out_dir / "preprocessor_config.json",
                {**QWEN2_VL_IMAGE_PROCESSOR, "processor_class": processor_class})
    ids = bpe.get_vocab(with_added_tokens=True)
    config = config_class(
        text_config={
            "vocab_size": bpe.get_vocab_size(with_added_tokens=True),
            "hidden_size": 4 * QWEN_HEAD_DIM,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": MAX_POSITIONS,
            # mrope splits each head's rotary half into (temporal, height, width) sections.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [8, 12, 12],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            **vision,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    generation = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    _save_model(out_dir, model_class, config, generation, seed)


@dataclass(frozen=True)
class _Tokens:
    """A LLaVA family's tokenizer: its special tokens and which of them play which part."""

    special: list[str]
    eos: str
    pad: str
    bos: str | None = None
    """Prepended to every text when the tokenizer adds special tokens (Llama's `<s>`)."""
    unk: str | None = None
    named: dict[str, str] = field(default_factory=dict)
    """The processor's tokens by their attribute name (`image_token`); the model config has
    each one's id as NAME_index, unless `config_ids` says otherwise."""
    config_ids: dict[str, str] | None = None
    """The model config's fields that hold a token's id, and their tokens."""

    def ids_in_config(self, ids: dict[str, int]) -> dict[str, int]:
        config_ids = self.config_ids
        if config_ids is None:
            config_ids = {f"{name}_index": token for name, token in self.named.items()}
        return {name: ids[token] for name, token in config_ids.items()}


LLAMA_TOKENS = _Tokens(
    special=["<unk>", "<s>", "</s>", "<image>", "<pad>"], eos="</s>", pad="<pad>", bos="<s>",
    unk="<unk>", named={"image_token": "<image>"},
)

QWEN_LLAVA_TOKENS = _Tokens(
    special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"],
    eos="<|im_end|>", pad="<|endoftext|>",
    named={"image_token": "<image>", "video_token": "<video>"},
)

MISTRAL_TOKENS = _Tokens(
    special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[IMG_BREAK]",
             "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
             "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
    eos="</s>", pad="<pad>", bos="<s>", unk="<unk>", named={"image_token": "[IMG]"},
)

INTERNVL_TOKENS = _Tokens(
    special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>",
             "<video>"],
    eos="<|im_end|>", pad="<|endoftext|>",
    named={"start_image_token": "<img>", "end_image_token": "</img>",
           "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
    config_ids={"image_token_id": "<IMG_CONTEXT>"},
)

IDEFICS3_IMAGE_TOKENS = [
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
    *[f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)],
]
"""The tokens of Idefics3's and SmolVLM's images and turns."""
IDEFICS3_TOKENS = _Tokens(
    special=["<|begin_of_text|>", "<|end_of_text|>", *IDEFICS3_IMAGE_TOKENS],
    eos="<end_of_utterance>", pad="<|end_of_text|>",
)
SMOLVLM_TOKENS = _Tokens(
    special=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *IDEFICS3_IMAGE_TOKENS, "<video>"],
    eos="<end_of_utterance>", pad="<|im_end|>",
)

# A tiny tower's size; its image and patch size are the processor's (the caller's).
TINY_VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
}


def _clip_tower() -> CLIPVisionConfig:
    """LLaVA-1.5's and LLaVA-NeXT's tower, tiny: CLIP at 336 pixels, its features taken from
    the second-last layer without the CLS one (`CLIP_FEATURES`)."""
    return CLIPVisionConfig(image_size=336, patch_size=14, projection_dim=32, **TINY_VISION)


CLIP_FEATURES: dict[str, Any] = {
    "vision_feature_select_strategy": "default", "vision_feature_layer": -2,
}


def _build_llava(out_dir: Path, seed: int) -> None:
    _build_llava_like(
        out_dir, seed, LlavaConfig, LlavaForConditionalGeneration, LLAMA_TOKENS,
        vision_config=_clip_tower(), text_config_class=LlamaConfig,
        chat_template=LLAVA_CHAT_TEMPLATE, image_processor=LLAVA_IMAGE_PROCESSOR,
        processor=LLAVA_PROCESSOR, **CLIP_FEATURES,
    )


def _build_llava_next(out_dir: Path, seed: int) -> None:
    # LLaVA-v1.6-Mistral: LLaVA's CLIP tower and projector, a Mistral language model, the anyres
    # tiles and the learned image_newline (LlavaNextForConditionalGeneration's own).
    _build_llava_like(
        out_dir, seed, LlavaNextConfig, LlavaNextForConditionalGeneration, LLAMA_TOKENS,
        vision_config=_clip_tower(), text_config_class=MistralConfig,
        chat_template=LLAVA_NEXT_CHAT_TEMPLATE, image_processor=LLAVA_NEXT_IMAGE_PROCESSOR,
        processor=LLAVA_NEXT_PROCESSOR,
        # As Mistral-7B-Instruct-v0.2: full attention over 32k positions, room for a few
        # images of up to 2,928 tokens each.
        max_positions=32768, text_fields={"sliding_window": None},
        image_grid_pinpoints=LLAVA_NEXT_GRID_PINPOINTS, **CLIP_FEATURES,
    )


def _build_llava_onevision(out_dir: Path, seed: int) -> None:
    # LLaVA-OneVision-Qwen2: a SigLIP tower (no CLS, no head), a Qwen2 language model, the anyres
    # tiles pooled down past 9 tiles' worth, and the image_newline.
    _build_llava_like(
        out_dir, seed, LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
        QWEN_LLAVA_TOKENS,
        vision_config=SiglipVisionConfig(
            image_size=384, patch_size=14, vision_use_head=False, **TINY_VISION
        ),
        text_config_class=Qwen2Config, chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE,
        image_processor=LLAVA_ONEVISION_IMAGE_PROCESSOR, processor=LLAVA_ONEVISION_PROCESSOR,
        # As Qwen2-0.5B: 32k positions, room for a few images of up to ~7,000 tokens each.
        max_positions=32768,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9", image_grid_pinpoints=LLAVA_ONEVISION_GRID_PINPOINTS,
    )


def _build_mistral3(out_dir: Path, seed: int) -> None:
    # Mistral 3.1: a Pixtral tower (2-D RoPE over patch rows and columns, up to the 1540-pixel
    # images of the processor), a patch merger of 2x2 patches, a Mistral language model.
    _build_llava_like(
        out_dir, seed, Mistral3Config, Mistral3ForConditionalGeneration, MISTRAL_TOKENS,
        vision_config=PixtralVisionConfig(
            image_size=1540, patch_size=14, hidden_act="silu", **TINY_VISION
        ),
        text_config_class=MistralConfig, chat_template=MISTRAL3_CHAT_TEMPLATE,
        image_processor=MISTRAL3_IMAGE_PROCESSOR, processor=MISTRAL3_PROCESSOR,
        # As Mistral-Small-3.1: full attention; 32k positions are room for a few images of up
        # to 3,080 tokens each.
        max_positions=32768, text_fields={"sliding_window": None, "head_dim": QWEN_HEAD_DIM},
        spatial_merge_size=2, vision_feature_layer=-1, multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )


def _build_internvl(out_dir: Path, seed: int) -> None:
    # InternVL3-hf: InternViT at 448 pixels (mean pooling, layer scale), a pixel shuffle of
    # 2x2 features into one and an MLP projector, a Qwen2 language model.
    _build_llava_like(
        out_dir, seed, InternVLConfig, InternVLForConditionalGeneration, INTERNVL_TOKENS,
        vision_config=InternVLVisionConfig(image_size=[448, 448], patch_size=[14, 14],
                                           **TINY_VISION),
        text_config_class=Qwen2Config, chat_template=INTERNVL_CHAT_TEMPLATE,
        image_processor=INTERNVL_IMAGE_PROCESSOR, processor=INTERNVL_PROCESSOR,
        # As Qwen2.5-0.5B: 32k positions, room for a few images of up to 3,330 tokens each.
        max_positions=32768, downsample_ratio=0.5, image_seq_length=256, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )


def _build_llava_like(
    out_dir: Path, seed: int, config_class: Callable[..., PretrainedConfig],
    model_class: type[PreTrainedModel], tokens: _Tokens, *, vision_config: PretrainedConfig,
    text_config_class: Callable[..., PretrainedConfig], chat_template: str, image_processor: dict,
    processor: dict, max_positions: int = MAX_POSITIONS, text_fields: dict | None = None,
    **config_fields: Any,
) -> None:
    """A tiny LLaVA-architecture model (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, Mistral 3,
    InternVL): the family's tokenizer and template, a small vision tower, a small language
    model whose heads are QWEN_HEAD_DIM wide (as vLLM's CPU attention takes them), and its own
    settings on top (`text_fields` of its language model, `config_fields` of the whole)."""
    bpe = _save_family_tokenizer(out_dir, tokens, chat_template, max_positions)
    _write_json(out_dir / "preprocessor_config.json", image_processor)
    _write_json(out_dir / "processor_config.json", processor)
    ids = bpe.get_vocab(with_added_tokens=True)
    config = config_class(
        vision_config=vision_config,
        text_config=_text_config(text_config_class, bpe, tokens, max_positions,
                                 hidden_size=4 * QWEN_HEAD_DIM, **(text_fields or {})),
        # e.g. image_token_index (and video_token_index): the ids of the processor's tokens
        **tokens.ids_in_config(ids),
        **config_fields,
    )
    _save_model(out_dir, model_class, config, _generation_config(bpe, tokens), seed)
    if isinstance(vision_config, CLIPVisionConfig | SiglipVisionConfig):
        _publish_tower_names(out_dir / "model.safetensors")


def _publish_tower_names(checkpoint: Path) -> None:
    """Name a CLIP or SigLIP tower's weights as published LLaVA checkpoints do
    (`vision_tower.vision_model.*`): transformers 5 saves them without the `vision_model`
    level its own modules lack, which it adds back on loading, but vLLM loads by the
    published names."""
    weights = load_file(checkpoint)
    published = {
        name.replace(TOWER, f"{TOWER}vision_model.", 1)
        if name.startswith(TOWER) and not name.startswith(f"{TOWER}vision_model.") else name: value
        for name, value in weights.items()
    }
    save_file(published, checkpoint, metadata={"format": "pt"})


TOWER = "vision_tower."


def _save_family_tokenizer(
    out_dir: Path, tokens: _Tokens, chat_template: str, max_positions: int
) -> Tokenizer:
    """Train and save the tokenizer of a family with these tokens; returns it."""
    bpe = _train_bpe(tokens.special)
    named: dict[str, str | dict] = {"eos_token": tokens.eos, "pad_token": tokens.pad}
    if tokens.bos is not None:
        # Llama tokenizers prepend BOS when asked for special tokens; keep that so the tiny
        # model exercises the same path as a real one.
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{tokens.bos} $A", pair=f"{tokens.bos} $A {tokens.bos} $B",
            special_tokens=[(tokens.bos, bpe.token_to_id(tokens.bos))],
        )
        named["bos_token"] = tokens.bos
    if tokens.unk is not None:
        named["unk_token"] = tokens.unk
    _save_tokenizer(
        out_dir, bpe, chat_template, max_positions, **named, extra_special_tokens=tokens.named
    )
    return bpe


def _text_config(
    text_config_class: Callable[..., PretrainedConfig], bpe: Tokenizer, tokens: _Tokens,
    max_positions: int, *, hidden_size: int, **fields: Any,
) -> PretrainedConfig:
    """A small language model over the family's tokenizer: two layers, four heads; `fields`
    add to these or replace them (Mistral 3's head_dim)."""
    ids = bpe.get_vocab(with_added_tokens=True)
    return text_config_class(**{
        "vocab_size": bpe.get_vocab_size(with_added_tokens=True),
        "hidden_size": hidden_size,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_positions,
        "bos_token_id": ids[tokens.bos or tokens.pad],
        "eos_token_id": ids[tokens.eos],
        "pad_token_id": ids[tokens.pad],
        **fields,
    })


def _generation_config(bpe: Tokenizer, tokens: _Tokens) -> GenerationConfig:
    ids = bpe.get_vocab(with_added_tokens=True)
    return GenerationConfig(
        bos_token_id=ids[tokens.bos or tokens.pad], eos_token_id=ids[tokens.eos],
        pad_token_id=ids[tokens.pad],
    )


def _build_idefics3(out_dir: Path, seed: int) -> None:
    # Idefics3-8B-Llama3: a SigLIP tower at 364 pixels, pixel shuffle by 2 (169 tokens a
    # tile), a Llama language model; tiles of up to 4x4 beside the whole image.
    _build_idefics3_like(
        out_dir, seed, Idefics3Config, Idefics3ForConditionalGeneration, IDEFICS3_TOKENS,
        chat_template=_utterance_template("<|begin_of_text|>"),
        image_processor=IDEFICS3_IMAGE_PROCESSOR,
        processor=IDEFICS3_PROCESSOR, image_size=364, patch_size=14, scale_factor=2,
    )


def _build_smolvlm(out_dir: Path, seed: int) -> None:
    # SmolVLM-256M: SigLIP base patch-16 at 512 pixels, pixel shuffle by 4 (64 tokens a tile),
    # a SmolLM2 (Llama) language model; tiles of up to 4x4 beside the whole image.
    _build_idefics3_like(
        out_dir, seed, SmolVLMConfig, SmolVLMForConditionalGeneration, SMOLVLM_TOKENS,
        chat_template=_utterance_template("<|im_start|>"), image_processor=SMOLVLM_IMAGE_PROCESSOR,
        processor=SMOLVLM_PROCESSOR, image_size=512, patch_size=16, scale_factor=4,
    )


def _build_idefics3_like(
    out_dir: Path, seed: int, config_class: Callable[..., PretrainedConfig],
    model_class: type[PreTrainedModel], tokens: _Tokens, *, chat_template: str,
    image_processor: dict, processor: dict, image_size: int, patch_size: int,
    scale_factor: int,
) -> None:
    """A tiny Idefics3-architecture model (Idefics3, SmolVLM): a small SigLIP-like tower at
    the processor's tile size, the connector's pixel shuffle, a small Llama language model
    whose heads are 64 wide (as vLLM's CPU attention takes them)."""
    bpe = _save_family_tokenizer(out_dir, tokens, chat_template, IDEFICS3_MAX_POSITIONS)
    _write_json(out_dir / "preprocessor_config.json", image_processor)
    _write_json(out_dir / "processor_config.json", processor)
    ids = bpe.get_vocab(with_added_tokens=True)
    config = config_class(
        vision_config={**TINY_VISION, "image_size": image_size, "patch_size": patch_size},
        text_config=_text_config(
            LlamaConfig, bpe, tokens, IDEFICS3_MAX_POSITIONS, hidden_size=4 * QWEN_HEAD_DIM,
        ).to_dict(),
        image_token_id=ids["<image>"],
        scale_factor=scale_factor,
        pad_token_id=ids[tokens.pad],
    )
    _save_model(out_dir, model_class, config, _generation_config(bpe, tokens), seed)


def _train_bpe(special_tokens: list[str]) -> Tokenizer:
    """A byte-level BPE trained on the shipped corpus, with `special_tokens` appended after it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in special_tokens]
    )
    return tokenizer


def _save_tokenizer(
    out_dir: Path, bpe: Tokenizer, chat_template: str, max_positions: int = MAX_POSITIONS,
    **special_tokens: str | dict,
) -> None:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        chat_template=chat_template,
        model_max_length=max_positions,
        **special_tokens,
    )
    tokenizer.save_pretrained(out_dir)


def _save_model(
    out_dir: Path,
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    generation: GenerationConfig,
    seed: int,
) -> None:
    # A private RNG stream: the weights depend on `seed` alone, and callers' RNG state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()
    model.generation_config = generation
    model.save_pretrained(out_dir)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


_BUILDERS: dict[str, Callable[[Path, int], None]] = {
    "qwen2_vl": _build_qwen2_vl,
    "qwen2_5_vl": _build_qwen2_5_vl,
    "llava": _build_llava,
    "llava_next": _build_llava_next,
    "llava_onevision": _build_llava_onevision,
    "mistral3": _build_mistral3,
    "internvl": _build_internvl,
    "idefics3": _build_idefics3,
    "smolvlm": _build_smolvlm,
}
