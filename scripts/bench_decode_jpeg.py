"""JPEG reduce-on-decode (`--jpeg-draft`) against the exact decode, side by side in one process;
and simplejpeg's decoder against Pillow's.

    python scripts/bench_decode_jpeg.py [--repeats 10]

1. Time: per 4032x3024 photo-like JPEG (bench_common.big_jpeg), the MM worker's work for one
   image (`process_image`: decode + the tiny Qwen2-VL's image processor, PIL backend, uint8
   path) with `jpeg_draft` off and on, alternating, so that drift in the machine's load hits
   both alike; min / median of the decode, the processor and both.
2. Difference: for 4032x3024, 2000x1500, a tall 1500x6000 JPEG and 2323x1742 (the smallest
   4:3 JPEG the tiny model drafts: the worst case), the reduction drafted, the grid of both
   paths, and the mean and max |diff| against the exact path of the uint8 pixels and of the
   normalised tensor (`normalize`, what the engine computes from them).
3. When simplejpeg imports (it is no dependency: `pip install simplejpeg` to evaluate it): at
   4032x3024, the MM worker's decode (`decode_image`, Pillow) against simplejpeg's decode to an
   RGB array, and that array wrapped as a PIL image (what the processor takes), alternating
   (medians); and whether simplejpeg's pixels equal Pillow's `Image.open(...).convert("RGB")`
   bit for bit, on JPEGs with 4:2:0, 4:2:2 and 4:4:4 chroma subsampling, progressive,
   grayscale and CMYK.

It asserts nothing.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from bench_common import BIG, big_jpeg
from PIL import Image

from bench.images import encode, make_image
from mmlane.mm_worker.media import MediaPolicy, decode_image, jpeg_draft_scale
from mmlane.mm_worker.pool import Processed, process_image
from mmlane.model import Preprocessor, load_preprocessor, normalize, resolve_model_dir

DIFF_SIZES = [BIG, (2000, 1500), (1500, 6000), (2323, 1742)]
"""The phone photo, one too small to draft, a tall one, the smallest 4:3 one drafted."""
JPEG_KINDS: dict[str, Callable[[Image.Image], bytes]] = {
    "4:2:0": lambda image: encode(image, quality=90, subsampling=2),
    "4:2:2": lambda image: encode(image, quality=90, subsampling=1),
    "4:4:4": lambda image: encode(image, quality=90, subsampling=0),
    "progressive 4:2:0": lambda image: encode(image, quality=90, progressive=True),
    "grayscale": lambda image: encode(image.convert("L"), quality=90),
    "CMYK": lambda image: encode(image.convert("CMYK"), quality=90),
}


def processed(pre: Preprocessor, jpeg: bytes, draft: bool) -> Processed:
    media = MediaPolicy(allowed_media_dir=None, max_image_bytes=1 << 30,
                        max_image_pixels=10**9, jpeg_draft=draft)
    return process_image(pre, 0, jpeg, media)


def ms(values: list[float]) -> str:
    return f"min {min(values) * 1e3:6.1f} ms  median {statistics.median(values) * 1e3:6.1f} ms"


def time_draft(pre: Preprocessor, repeats: int) -> None:
    jpeg = big_jpeg()
    runs: dict[bool, list[Processed]] = {False: [], True: []}
    for _ in range(repeats):
        for draft in (False, True):
            runs[draft].append(processed(pre, jpeg, draft))
    print(f"1. {BIG[0]}x{BIG[1]} JPEG ({len(jpeg):,} bytes), {repeats} runs of each, alternating")
    totals = {}
    for draft, done in runs.items():
        totals[draft] = [d.decode_s + d.process_s for d in done]
        print(f"  draft {'on ' if draft else 'off'}  decode {ms([d.decode_s for d in done])}  "
              f"processor {ms([d.process_s for d in done])}  both {ms(totals[draft])}")
    speedup = statistics.median(totals[False]) / statistics.median(totals[True])
    print(f"  decode + processor, off / on (medians): {speedup:.2f}x")


def abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.float64) - b.astype(np.float64))


def difference(pre: Preprocessor, width: int, height: int) -> None:
    jpeg = encode(make_image(width, height, seed=1), quality=90)
    exact, drafted = (processed(pre, jpeg, draft).item.tensors for draft in (False, True))
    scale = jpeg_draft_scale(width, height, pre.resized_size)
    grids = [tuple(t["image_grid_thw"][0].tolist()) for t in (exact, drafted)]
    print(f"  {width}x{height}: drafted 1/{scale}, grid {grids[0]} / {grids[1]}", end="")
    if grids[0] != grids[1]:
        print("  (grids differ: no pixel diff)")
        return
    u8 = abs_diff(exact["pixel_values"], drafted["pixel_values"])
    floats = [normalize(torch.from_numpy(t["pixel_values"]), pre.pixel_norm).numpy()
              for t in (exact, drafted)]
    normalised = abs_diff(*floats)
    print(f"  uint8 mean {u8.mean():.3f} max {u8.max():.0f}  "
          f"normalised mean {normalised.mean():.4f} max {normalised.max():.4f}")


def compare_simplejpeg(repeats: int) -> None:
    try:
        import simplejpeg
    except ImportError:
        print("3. simplejpeg is not installed (pip install simplejpeg): skipped")
        return
    print(f"3. simplejpeg {simplejpeg.__version__} against Pillow {Image.__version__}, "
          f"{BIG[0]}x{BIG[1]}")
    decoders: dict[str, Callable[[bytes], object]] = {
        "pillow": lambda data: decode_image(data, 0, 10**9),
        "simplejpeg": lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB"),
        "+ PIL image": lambda data: Image.fromarray(simplejpeg.decode_jpeg(data, colorspace="RGB")),
    }
    image = make_image(*BIG, seed=1)
    for kind, make in JPEG_KINDS.items():
        jpeg = make(image)
        reference = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        try:
            theirs = simplejpeg.decode_jpeg(jpeg, colorspace="RGB")
        except ValueError as exc:
            print(f"  {kind:18s} simplejpeg refuses it: {exc}")
            continue
        times: dict[str, list[float]] = {name: [] for name in decoders}
        for _ in range(repeats):
            for name, decode in decoders.items():
                started = time.perf_counter()
                decode(jpeg)
                times[name].append(time.perf_counter() - started)
        same = reference.shape == theirs.shape and np.array_equal(reference, theirs)
        detail = "bit-identical" if same else (
            f"differs: mean |diff| {abs_diff(reference, theirs).mean():.4f}, "
            f"max {abs_diff(reference, theirs).max():.0f}")
        medians = "  ".join(f"{name} {statistics.median(values) * 1e3:5.1f}"
                            for name, values in times.items())
        print(f"  {kind:18s} median ms: {medians}  {detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="runs of each path (default 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in an MM worker's pool process
    pre = load_preprocessor(resolve_model_dir(None), "pil")
    time_draft(pre, args.repeats)
    print("2. difference against the exact decode (photo-like JPEGs, quality 90)")
    for width, height in DIFF_SIZES:
        difference(pre, width, height)
    compare_simplejpeg(args.repeats)


if __name__ == "__main__":
    main()
