"""`--encoder-lane` for both vLLM backends: images' embeddings made in mmlane, awaited on the
runner's loop thread, so that vLLM runs only the language model.

Each image's embeddings come from the encoder cache (vision-encoder outputs by the image's hash,
bounded by --encoder-cache-gb, the most recently used kept), from the pass under way for the
same hash, or from a new pass on the vision lane (services/engine/vision.py: the embedded
runner's, a thread at --image-nice). A request cancelled while it waits stops waiting; the pass
is cancelled too when no other request waits for it and it has not started. The counters
encoder_cache_hits and encoder_cache_misses say how often a repeated image skipped its pass.
Videos are not the lane's: both backends send a video's pixels, and vLLM runs its vision pass.

    load_lane(config, model_dir, preprocessor, families)   the lane's encoder, or None
    EncoderLane(encoder, image_token_id, vision, loop, metrics)
                                                            its face on the loop thread
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mmlane.common.feature_cache import FeatureCache, capacity_bytes
from mmlane.common.stats import Metrics
from mmlane.engine.config import EngineConfig, VisionConfig
from mmlane.engine.vision import VisionEncoder, VisionLane, load_encoder, torch_threads
from mmlane.model import Preprocessor
from mmlane.protocol.errors import FatalError, RequestError, translate
from mmlane.protocol.messages import EngineRequest, MMItem


def load_lane(config: EngineConfig, model_dir: Path, preprocessor: Preprocessor,
              families: Collection[str]) -> VisionEncoder | None:
    """The vision encoder for --encoder-lane on `--encoder-device`, None without the flag;
    FatalError (bad_config) for a model of a family whose embeddings the backend cannot hand
    vLLM (not among `families`)."""
    if not config.vllm.encoder_lane:
        return None
    family = preprocessor.family.name
    if family not in families:
        raise FatalError(f"--encoder-lane does not support {family} models: {NO_EMBEDS}; it "
                         f"supports those of {', '.join(families)}", code="bad_config")
    return load_encoder(model_dir, preprocessor, config.vllm.encoder_device)


NO_EMBEDS = ("vLLM 0.32 cannot take their images' embeddings: its Mistral 3 reads none, and its "
             "LLaVA-NeXT, LLaVA-OneVision, InternVL and Idefics3 check that the embeddings of "
             "the images one step encodes all have one length, which theirs (sized by each "
             "image's tiles) do not, and end the engine core where they differ")
"""Why the families the lane lacks cannot be served with it. Measured on vLLM 0.32 CPU for
Mistral 3 ('Required field pixel_values is missing'), and for InternVL, Idefics3 and LLaVA-NeXT
(two images of other tile counts in one request: 'data contains inconsistent shapes');
LLaVA-OneVision's embedding schema is LLaVA-NeXT's, (bn, ifs, hs) without a dynamic dimension."""


@dataclass
class _Pass:
    """A pass on the lane, and how many requests wait for it."""

    mm_hash: str
    future: asyncio.Future[torch.Tensor]
    waiting: int = 0


class EncoderLane:
    """Images' embeddings (image tokens, hidden) on the CPU, for coroutines on `loop`'s thread
    (see the module docstring)."""

    def __init__(self, encoder: VisionEncoder, image_token_id: int, vision: VisionConfig,
                 loop: asyncio.AbstractEventLoop, metrics: Metrics) -> None:
        self._image_token_id = image_token_id
        self._loop = loop
        self.metrics = metrics
        self._cache: FeatureCache[torch.Tensor] = FeatureCache(
            capacity_bytes(vision.encoder_cache_gb, "encoder_cache_gb"))
        self._passes: dict[int, _Pass] = {}
        """The passes submitted and not yet taken back, by job number (loop thread only)."""
        self._of_image: dict[str, int] = {}
        """The job of the pass under way for an image's hash."""
        self._jobs = itertools.count()
        self._vision = VisionLane(lambda tensors: encoder(tensors).cpu(),
                                  threads=vision.vision_threads or torch_threads(0),
                                  device=torch.device("cpu"), nice=vision.image_nice,
                                  wake=self._woke)

    def close(self) -> None:
        self._vision.close()

    def _woke(self) -> None:  # on the vision lane's thread
        self._loop.call_soon_threadsafe(self._take)

    async def embeddings(self, request: EngineRequest,
                         indices: Iterable[int]) -> list[torch.Tensor]:
        """The embeddings of the request's images at `indices`, made at once."""
        return list(await asyncio.gather(*(self._encode(request, index) for index in indices)))

    async def _encode(self, request: EngineRequest, index: int) -> torch.Tensor:
        """An image's embeddings, as many as the image tokens of its span (RequestError when a
        cached image of its hash made another count)."""
        item = request.mm_items[index]
        span = request.prompt_token_ids[item.offset:item.offset + item.length]
        tokens = sum(1 for token in span if token == self._image_token_id)
        cached = self._cache.touch(item.mm_hash) if item.mm_hash else None
        if cached is not None:
            self.metrics.counters["encoder_cache_hits"] += 1
            embeds = cached
        else:
            embeds = await self._wait(self._pass_for(item))
        if embeds.shape[0] != tokens:
            raise RequestError(f"mm_items[{index}] has {tokens} image tokens, but its image "
                               f"made {embeds.shape[0]} image embeddings")
        return embeds

    def _pass_for(self, item: MMItem) -> int:
        """The job of the pass for `item`: the one under way for its hash, else a new one."""
        job = self._of_image.get(item.mm_hash) if item.mm_hash else None
        if job is not None:  # the same bits as from the cache
            self.metrics.counters["encoder_cache_hits"] += 1
            return job
        if item.mm_hash:
            self.metrics.counters["encoder_cache_misses"] += 1
            self._of_image[item.mm_hash] = job = next(self._jobs)
        else:
            job = next(self._jobs)
        self._passes[job] = _Pass(item.mm_hash, self._loop.create_future())
        self._vision.submit(job, item.tensors)
        return job

    async def _wait(self, job: int) -> torch.Tensor:
        waited = self._passes[job]
        waited.waiting += 1
        try:
            return await asyncio.shield(waited.future)
        except asyncio.CancelledError:
            if waited.waiting == 1 and not waited.future.done():  # nobody else waits for it
                self._vision.cancel(job)
                self._forget(waited, job)  # a request that comes now gets a pass of its own
            raise
        finally:
            waited.waiting -= 1

    def _forget(self, waited: _Pass, job: int) -> None:
        if waited.mm_hash and self._of_image.get(waited.mm_hash) == job:
            del self._of_image[waited.mm_hash]

    def _take(self) -> None:
        """The lane's results to the requests that wait for them, and to the cache."""
        for result in self._vision.finished():
            waited = self._passes.pop(result.job)
            self._forget(waited, result.job)
            features = result.features
            if isinstance(features, torch.Tensor):
                self.metrics.observe("engine_step:vision", result.seconds)
                if waited.mm_hash:
                    self._cache.put(waited.mm_hash, features.numel() * features.element_size(),
                                    features)
                    self.metrics.counters["encoder_cache_evictions"] = self._cache.evictions
            if features is None or not waited.waiting:  # cancelled, or nobody waits
                waited.future.cancel()
            elif isinstance(features, Exception):
                waited.future.set_exception(translate(
                    features, "the encoder lane failed on an image", default="model_error"))
            else:
                waited.future.set_result(features)
