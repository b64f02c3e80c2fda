"""What one 12 MP image costs on the vllm-remote backend's wire against mmlane's own ZMQ frames.

    python scripts/bench_remote_wire.py [--repeats 20]

A 4032x3024 photo-like JPEG is preprocessed as the MM worker does it for the embedded tiny
Qwen2-VL; then, for the request that carries it, the bytes and the encode time (median of
`--repeats`) of:
- `zmq frames`: mmlane's codec, the EngineRequest as the MM worker sends it to the engine (uint8
  pixels, one of the model's two identical frames);
- `remote body`: the JSON body of `POST /inference/v1/generate` (services/engine/vllm/remote.py),
  the image as vLLM's own item encoding (wire.py: uint8 pixels in the model's layout, both
  frames, base64 in JSON);
- `remote, held`: the same body for an image the replica's cache holds (sent as its hash);
- `remote, embeds`: the body with --encoder-lane, the image's embeddings in place of its pixels.
Then the same for Qwen2-VL-7B's size of the same photo (62,208 patches of 14x14, which it
keeps at 4032x3024: 15,552 embedding rows of 3,584 in bfloat16), as computed from random
tensors of those shapes. Asserts nothing.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.images import make_image  # noqa: E402
from mmlane.engine import wire  # noqa: E402
from mmlane.engine.vision import load_encoder  # noqa: E402
from mmlane.model import load_preprocessor, resolve_model_dir  # noqa: E402
from mmlane.protocol.codec import Codec  # noqa: E402
from mmlane.protocol.messages import (  # noqa: E402
    EngineInput,
    EngineRequest,
    MMItem,
    SamplingParams,
)


def timed(work: Callable[[], int], repeats: int) -> tuple[int, float]:
    """The bytes `work` makes and its median time in ms."""
    times, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        size = work()
        times.append((time.perf_counter() - start) * 1000)
    return size, statistics.median(times)


def costs(tensors: dict[str, np.ndarray], norm: object, embeds: torch.Tensor,
          repeats: int) -> None:
    request = EngineRequest(request_id="r", reply_to="x", prompt_token_ids=[1] * 64,
                            sampling=SamplingParams(),
                            mm_items=[MMItem(offset=0, length=1, tensors=tensors)])
    codec: Codec = Codec(EngineInput)

    def frames() -> int:
        return sum(len(memoryview(frame)) for frame in codec.encode(request))

    def body(item: Callable[[], str | None]) -> Callable[[], int]:
        return lambda: len(msgspec.json.encode({
            "token_ids": request.prompt_token_ids, "features": {"kwargs_data": {
                "image": [item()]}}}))

    pixels = body(lambda: wire.encode_item(wire.ITEMS["qwen2_vl"](tensors, norm)))  # type: ignore[arg-type]
    held = body(lambda: None)
    embedded = body(lambda: wire.encode_item(wire.EMBEDS["qwen2_vl"](tensors, embeds)))
    for name, work in (("zmq frames", frames), ("remote body", pixels),
                       ("remote, held", held), ("remote, embeds", embedded)):
        size, ms = timed(work, repeats)
        print(f"  {name:15} {size:>12,} bytes, encode {ms:7.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="encodes timed per figure")
    args = parser.parse_args()
    prep = load_preprocessor(resolve_model_dir(None))
    buffer = io.BytesIO()
    make_image(4032, 3024, seed=1).save(buffer, format="JPEG", quality=90)
    from PIL import Image

    item = prep.process_image(Image.open(io.BytesIO(buffer.getvalue())))
    with torch.inference_mode():
        embeds = load_encoder(resolve_model_dir(None), prep, "cpu")(item.tensors)
    print(f"tiny Qwen2-VL, 4032x3024 JPEG ({len(buffer.getvalue()) / 1e6:.1f} MB), pixels "
          f"{item.tensors['pixel_values'].shape}, embeddings {tuple(embeds.shape)} "
          f"{embeds.dtype}:")
    costs(item.tensors, prep.pixel_norm, embeds, args.repeats)
    rows = 62208
    big = {"pixel_values": np.random.default_rng(0).integers(
               0, 256, (rows, item.tensors["pixel_values"].shape[1]), dtype=np.uint8),
           "image_grid_thw": np.array([[1, 216, 288]])}
    big_embeds = torch.randn(rows // 4, 3584, dtype=torch.bfloat16)
    print(f"Qwen2-VL-7B's size of the same photo, pixels {big['pixel_values'].shape}, "
          f"embeddings {tuple(big_embeds.shape)} {big_embeds.dtype}:")
    costs(big, prep.pixel_norm, big_embeds, max(3, args.repeats // 4))


if __name__ == "__main__":
    main()
