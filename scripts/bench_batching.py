"""Image work of two requests in one forward pass: is it exact, and what does it save?

    python scripts/bench_batching.py [--model DIR] [--sizes 224x224,224x224]
                                     [--chunk-tokens 64,256] [--threads N] [--repeats 30]

The HF runner runs a vision pass and a prefill chunk for one request at a time (issue 11,
part 2 asks whether several requests' can share a forward pass and stay exact). For a Qwen2-VL
model (default: the embedded tiny-qwen2-vl), this script compares, alone and batched:

- vision: the two images of `--sizes` through the vision tower one by one, and both in one call
  (their patches concatenated, as transformers batches a prompt's images). Are each image's
  features the same bits?
- prefill: two random prompts of each `--chunk-tokens` length through the text layers one by
  one, and as one batch of two rows (same length, no padding). Are the hidden states the same
  bits, and the last token's logits, with the LM head run on both rows at once and on each row
  alone?

Pixels come from mmlane's own rendering (`Preprocessor.process_image`, normalised as the engine
does). Timings alternate alone and batched (`--repeats` each, after a warm-up); prints the
median of each and their ratio. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration

from mmlane.model import load_preprocessor, normalize, resolve_model_dir


def alternate(first: Callable[[], object], second: Callable[[], object],
              repeats: int) -> tuple[float, float]:
    """Median milliseconds of each, run in turns after one warm-up run of each."""
    times: tuple[list[float], list[float]] = ([], [])
    first(), second()
    for _ in range(repeats):
        for work, kept in ((first, times[0]), (second, times[1])):
            started = time.perf_counter()
            work()
            kept.append(time.perf_counter() - started)
    return statistics.median(times[0]) * 1000, statistics.median(times[1]) * 1000


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    return "equal" if torch.equal(a, b) else f"differ (max |diff| {(a - b).abs().max():.3g})"


def vision(model: Qwen2VLForConditionalGeneration, items: list[dict[str, torch.Tensor]],
           repeats: int) -> None:
    visual = model.model.visual

    def encode(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return visual(pixels, grid_thw=grid).pooler_output

    def one_by_one() -> list[torch.Tensor]:
        return [encode(item["pixel_values"], item["image_grid_thw"]) for item in items]

    def together() -> torch.Tensor:
        return encode(torch.cat([item["pixel_values"] for item in items]),
                      torch.cat([item["image_grid_thw"] for item in items]))

    alone = one_by_one()
    batched = torch.split(together(), [len(features) for features in alone])
    for index, (a, b) in enumerate(zip(alone, batched, strict=True)):
        print(f"vision, image {index} ({len(a)} tokens): batched {same(a, b)}")
    ms_alone, ms_batched = alternate(one_by_one, together, repeats)
    print(f"vision: one by one {ms_alone:.2f} ms, batched {ms_batched:.2f} ms "
          f"({ms_alone / ms_batched:.2f}x)")


def prefill(model: Qwen2VLForConditionalGeneration, tokens: int, repeats: int) -> None:
    text, head = model.model.language_model, model.lm_head
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(model.config.text_config.vocab_size, (2, tokens), generator=generator)
    embeds = model.model.get_input_embeddings()(ids)
    positions = torch.arange(tokens).view(1, 1, tokens).expand(3, 1, tokens)  # M-RoPE, text

    def one_by_one() -> list[torch.Tensor]:
        return [text(inputs_embeds=embeds[row:row + 1], position_ids=positions,
                     use_cache=False).last_hidden_state for row in range(2)]

    def together() -> torch.Tensor:
        return text(inputs_embeds=embeds, position_ids=positions.expand(3, 2, tokens),
                    use_cache=False).last_hidden_state

    alone, batched = one_by_one(), together()
    for row in range(2):
        print(f"prefill {tokens}, prompt {row}: hidden states {same(alone[row][0], batched[row])}")
    logits_alone = torch.cat([head(hidden[:, -1]) for hidden in alone])
    print(f"prefill {tokens}: last logits, LM head on both rows at once "
          f"{same(logits_alone, head(batched[:, -1]))}; on each row alone "
          f"{same(logits_alone, torch.cat([head(batched[row:row + 1, -1]) for row in range(2)]))}")
    ms_alone, ms_batched = alternate(one_by_one, together, repeats)
    print(f"prefill {tokens}: one by one {ms_alone:.2f} ms, batched {ms_batched:.2f} ms "
          f"({ms_alone / ms_batched:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="a Qwen2-VL model directory (default: the embedded tiny-qwen2-vl)")
    parser.add_argument("--sizes", default="224x224,224x224",
                        help="the two images, WxH (default 224x224,224x224)")
    parser.add_argument("--chunk-tokens", default="64,256",
                        help="prefill lengths to try (default 64,256)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default 0: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=30,
                        help="timed runs of each way (default 30)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    preprocessor = load_preprocessor(model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    rng = np.random.default_rng(0)
    items = []
    for size in args.sizes.split(","):
        width, height = (int(side) for side in size.split("x"))
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        tensors = {name: torch.from_numpy(array)
                   for name, array in preprocessor.process_image(image).tensors.items()}
        tensors["pixel_values"] = normalize(tensors["pixel_values"], preprocessor.pixel_norm)
        items.append(tensors)
    print(f"{model_dir.name}, {torch.get_num_threads()} torch threads")
    with torch.inference_mode():
        vision(model, items, args.repeats)
        for tokens in (int(count) for count in args.chunk_tokens.split(",")):
            prefill(model, tokens, args.repeats)


if __name__ == "__main__":
    main()
