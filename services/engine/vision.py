"""The vision lane: images' vision-encoder passes on a thread of their own, apart from text work.

Both backends run one: the 'hf' runner always, the 'vllm' runner with `--encoder-lane` (vLLM
then gets each image's embeddings instead of its pixels, and runs only the language model).
An image's vision pass is the largest part of its engine work (a 1024x1024 image on the tiny
Qwen2-VL: about 165 ms on one CPU thread, against 45-60 ms for its prompt's prefill). Here one
thread runs each image's whole pass while text work goes on beside it: no text request waits
for a pass. Images go first: a video's pass (many frames: 10 s of 720p at 0.5 fps is 3,588
tokens on the tiny model) waits while images wait, through at most `IMAGES_AHEAD_OF_A_VIDEO`
image passes, so that neither a stream of videos holds images up nor a stream of images a
video for ever; images keep their order among themselves, and videos theirs. The lane's
thread runs `nice` steps below its creator's (`--image-nice`): where cores are shared, text
work takes one first. torch releases the GIL inside its operations, so the lane and text work
run at once on as many cores. A pass is the model's own `get_image_features` (`VisionEncoder`),
with the lane's own torch thread count (torch keeps the count per thread).

On CUDA the lane queues its kernels on a stream of its own, so that a pass and the creator's
work run on the GPU at once; the lane waits for its stream before a result leaves, and marks
the features as used on the creator's stream, so that their memory is not reused while the
creator's kernels still read it.

The lane holds no request state. Its user submits jobs by number, cancels the ones no request
waits for any more, and takes the results (`finished`); the lane calls `wake` after each result
so that a user waiting for work looks at once. Every job submitted before `close` gets exactly
one result: its features, the exception its pass raised, or None if it was cancelled before it
ran. Nothing a pass raises ends the lane's thread: what is not an Exception (a SystemExit from
a library, say) fails the job with a retryable error, and the next job runs.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from mmlane.common.config import usable_cores
from mmlane.common.lifecycle import lower_priority
from mmlane.model import PixelNorm, Preprocessor, load_model, normalize
from mmlane.model.video import VideoPreprocessor
from mmlane.protocol.errors import FatalError, RetryableError
from mmlane.protocol.messages import VIDEO_PIXELS

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
"""How long `close` waits for the pass under way to end."""
IMAGES_AHEAD_OF_A_VIDEO = 8
"""Image passes that may run while a video waits; then the oldest video runs."""


def pick_device(setting: str) -> str:
    """'auto' is CUDA when torch sees a GPU, else the CPU."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise FatalError(
            f"device {setting!r} was asked for but torch sees no CUDA device", code="bad_config"
        )
    return setting


def torch_threads(setting: int) -> int:
    """0 is every core this process may run on but two (an MM worker's and a frontend's), and
    at least one."""
    return setting or max(1, usable_cores() - 2)


def synchronize(device: torch.device) -> None:
    """Wait for the work this thread queued on the device (CUDA runs kernels asynchronously, on
    the thread's current stream), so that a time taken after it is the work's, not its
    launch's."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A received array (a read-only view of a ZMQ frame or a shared-memory slot) as a tensor
    of its own on `device`, on the calling thread's current stream. On CUDA it is copied once
    into pinned host memory and from there without blocking the thread (torch's pinned-memory
    cache keeps the block until the copy has run); on the CPU it is one plain copy."""
    if device.type != "cuda":
        return torch.from_numpy(np.array(array))
    dtype = torch.from_numpy(np.empty(0, array.dtype)).dtype
    staging = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    staging.numpy()[...] = array
    return staging.to(device, non_blocking=True)


class VisionEncoder:
    """One image's embeddings, (image tokens, hidden), on the model's device: the vision tower's
    pooled output through the model's own `get_image_features` (LLaVA-NeXT's with the image's
    `image_sizes`, so the tile grid, the unpadding and the image_newline are transformers' own;
    Idefics3's with the image's tiles as one sample, and no pixel_attention_mask: an image's own
    tiles are whole, the mask the model makes without one). These rows replace the image tokens
    of the image's span. A video's (with `video`, the model's video processing) go through the
    model's method it names (`model_features`) with the tensors it names: `get_video_features`
    (Qwen2-VL's with its `video_grid_thw`; LLaVA-OneVision's frames as a batch of one video,
    pooled and closed by the image_newline there), or InternVL's `get_image_features` (each
    frame an image of one tile), and replace its video tokens."""

    def __init__(self, model: Any, family: str, pixel_norm: PixelNorm,
                 video: VideoPreprocessor | None = None) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)
        self._tiles_are_one_sample = family == "idefics3"
        self._pixel_norm = pixel_norm
        self._video_processor = video

    def __call__(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        if VIDEO_PIXELS in tensors:
            return self._video(tensors)
        pixels = self._pixels(tensors)
        if self._tiles_are_one_sample:
            output = self.model.model.get_image_features(pixels[None], return_dict=True)
        else:
            inputs = {name: self.to_device(array) for name, array in tensors.items()
                      if name != "pixel_values"}
            output = self.model.model.get_image_features(pixel_values=pixels, **inputs,
                                                         return_dict=True)
        # a (tokens, hidden) tensor per image (per sample: this image's tiles, pooled)
        return torch.cat(list(output.pooler_output))

    def _video(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        video = self._video_processor
        if video is None:  # the engine's validation refuses videos then
            raise RuntimeError("this vision encoder was built without video")
        pixels = to_device(tensors[VIDEO_PIXELS], self.model.device)
        pixels = normalize(pixels, video.pixel_norm).to(self.model.dtype)
        inputs = {name: self.to_device(tensors[name]) for name in video.vision_inputs}
        method, argument = video.model_features
        output = getattr(self.model.model, method)(
            **{argument: video.model_pixels(pixels)}, **inputs, return_dict=True)
        return torch.cat(list(output.pooler_output))

    def _pixels(self, tensors: Mapping[str, np.ndarray]) -> torch.Tensor:
        """The uint8 pixel_values normalised on the device, as the HF processor would have
        (services/model/pixels.py), in the model's dtype."""
        pixels = to_device(tensors["pixel_values"], self.model.device)
        return normalize(pixels, self._pixel_norm).to(self.model.dtype)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """An array on the model's device: floats in its dtype, integers as int64."""
        tensor = to_device(array, self.model.device)
        return tensor.to(self.model.dtype if tensor.is_floating_point() else torch.long)


def load_encoder(model_dir: Path, preprocessor: Preprocessor, device: str) -> VisionEncoder:
    """The vision encoder of the model in `model_dir` on `device` ('auto' as `pick_device`),
    for a backend whose engine runs the language model elsewhere (vLLM): the model is loaded
    whole, then its language model is dropped."""
    network: Any = load_model(model_dir, pick_device(device))
    network.model.language_model = None
    network.lm_head = None
    return VisionEncoder(network, preprocessor.family.name, preprocessor.pixel_norm)


class VisionResult(NamedTuple):
    job: int
    features: torch.Tensor | Exception | None
    """The image's features; the exception its pass raised; None: cancelled before it ran."""
    seconds: float
    """How long its pass took (0 when it did not run)."""


class VisionLane:
    """Runs `encode` (an image's tensors to its features) for each submitted job, in order, on a
    thread `nice` steps below its creator's, with `threads` torch threads; `wake` is called
    after each result."""

    def __init__(self, encode: Callable[[Mapping[str, np.ndarray]], torch.Tensor], *,
                 threads: int, device: torch.device, wake: Callable[[], None],
                 nice: int) -> None:
        self._encode = encode
        self.threads = threads
        self._device = device
        self._wake = wake
        self._nice = nice
        self._user_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The creating thread's stream, which reads the features (CUDA only)."""
        self._cancelled: set[int] = set()
        """Jobs to skip if not yet started (set by the user's thread, read by the lane's)."""
        self._waiting = threading.Condition()
        """Guards the queues below and `_closing`; notified when a job comes or the lane ends."""
        self._images: collections.deque[tuple[int, Mapping[str, np.ndarray]]] = (
            collections.deque())
        self._videos: collections.deque[tuple[int, Mapping[str, np.ndarray]]] = (
            collections.deque())
        self._passed_video = 0
        """Image passes run since the oldest waiting video was first passed over."""
        self._closing = False
        self._results: queue.SimpleQueue[VisionResult] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="vision-lane", daemon=True)
        self._thread.start()

    def submit(self, job: int, tensors: Mapping[str, np.ndarray]) -> None:
        with self._waiting:
            (self._videos if VIDEO_PIXELS in tensors else self._images).append((job, tensors))
            self._waiting.notify()

    def cancel(self, job: int) -> None:
        """Skip `job` if its pass has not started (its result is then None)."""
        self._cancelled.add(job)

    def finished(self) -> list[VisionResult]:
        """The results that have come since the last call. A job cancelled after its pass ended
        is forgotten here, so that no cancel outlives its job."""
        results: list[VisionResult] = []
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return results
            self._cancelled.discard(result.job)
            results.append(result)

    def close(self) -> None:
        """End the thread after the pass under way (jobs still queued are dropped)."""
        with self._waiting:
            self._closing = True
            self._images.clear()
            self._videos.clear()
            self._waiting.notify()
        self._thread.join(CLOSE_TIMEOUT_S)

    def _next(self) -> tuple[int, Mapping[str, np.ndarray]] | None:
        """The next job to pass (None once closing): the oldest image, unless a video has
        waited through `IMAGES_AHEAD_OF_A_VIDEO` image passes or no image waits."""
        with self._waiting:
            self._waiting.wait_for(lambda: self._closing or self._images or self._videos)
            if self._closing:
                return None
            if self._videos and (not self._images
                                 or self._passed_video >= IMAGES_AHEAD_OF_A_VIDEO):
                self._passed_video = 0
                return self._videos.popleft()
            self._passed_video += bool(self._videos)
            return self._images.popleft()

    def _run(self) -> None:
        lower_priority(self._nice)
        torch.set_num_threads(self.threads)
        stream = None if self._user_stream is None else torch.cuda.Stream(self._device)
        with torch.inference_mode(), torch.cuda.stream(stream):
            while (job := self._next()) is not None:
                self._results.put(self._pass(*job))
                try:
                    self._wake()
                except Exception:  # its user's failure: the lane serves on
                    log.exception("the vision lane's wake failed")

    def _pass(self, job: int, tensors: Mapping[str, np.ndarray]) -> VisionResult:
        if job in self._cancelled:
            self._cancelled.discard(job)
            return VisionResult(job, None, 0.0)
        started = time.monotonic()
        try:
            encoded = self._encode(tensors)
            synchronize(self._device)  # the time is the pass's, not its launch's
            if self._user_stream is not None:
                encoded.record_stream(self._user_stream)
            features: torch.Tensor | Exception = encoded
        except Exception as exc:  # its user fails the requests that wait for it
            log.warning("a vision pass failed", exc_info=True)
            features = exc
        except BaseException as exc:  # not the image's fault: its requests may try again
            log.error("a vision pass died; the lane serves on", exc_info=True)
            features = RetryableError(f"the vision pass died ({type(exc).__name__}: {exc}); "
                                      f"the lane serves on", code="backend_died")
        self._cancelled.discard(job)
        return VisionResult(job, features, time.monotonic() - started)
