"""uint8 pixels against the float path, side by side in one process: per 4032x3024 JPEG, the
MM worker's work (decode + image processor) and the bytes it ships, and the engine's normalise.

    python scripts/bench_pixels.py [--repeats 10] [--model DIR]

float: decode + the HF image processor (PIL backend) as it is called by default, returning
normalised float32 (what the MM worker sent before issue 18). uint8: decode +
`Preprocessor.process_image` (the family's uint8 path: the processor's resize, patches laid out
in uint8). Then `mmlane.model.normalize` of those uint8 pixels with torch on the CPU (the
engine's side), checked bit-equal to the float path's output. Runs alternate, so drift in the
machine's load hits both alike. Prints min / median per step; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from bench_common import BIG, big_jpeg

from mmlane.mm_worker.media import decode_image
from mmlane.model import load_preprocessor, normalize, resolve_model_dir


def timed(work: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="runs of each path (default 10)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="model directory (default: the embedded tiny-qwen2-vl)")
    args = parser.parse_args()
    pre = load_preprocessor(resolve_model_dir(args.model))
    jpeg = big_jpeg()
    times: dict[str, list[float]] = {"float": [], "uint8": [], "normalize": []}
    for _ in range(args.repeats):
        seconds, batch = timed(lambda: pre.image_processor(
            images=[decode_image(jpeg, 0, 10**9)], return_tensors="np"))
        times["float"].append(seconds)
        # The one image's item (a batch may hold it padded or with a batch axis: LLaVA-NeXT).
        [expected] = pre.family.split_items(pre.image_processor, batch)
        floats = expected["pixel_values"]
        seconds, item = timed(lambda: pre.process_image(decode_image(jpeg, 0, 10**9)))
        times["uint8"].append(seconds)
        pixels = torch.from_numpy(item.tensors["pixel_values"])
        seconds, normalised = timed(partial(normalize, pixels, pre.pixel_norm))
        times["normalize"].append(seconds)
        assert np.array_equal(normalised.numpy(), floats), "normalised uint8 != float path"
    print(f"{pre.model_id}: {BIG[0]}x{BIG[1]} JPEG ({len(jpeg):,} bytes), {args.repeats} runs, "
          f"torch threads {torch.get_num_threads()}")
    for name, values in times.items():
        print(f"  {name:9s} min {min(values) * 1e3:7.1f} ms   median "
              f"{statistics.median(values) * 1e3:7.1f} ms")
    ratio = statistics.median(times["float"]) / statistics.median(times["uint8"])
    print(f"  MM worker work per image, float / uint8 (medians): {ratio:.2f}x")
    print(f"  pixel_values shipped: float32 {floats.nbytes:,} bytes, "
          f"uint8 {item.tensors['pixel_values'].nbytes:,} bytes")


if __name__ == "__main__":
    main()
