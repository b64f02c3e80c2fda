"""From an `MMJob` to the `EngineRequest` the engine runs: the work between the two sockets.

    1. check the job (placeholders, length); note the engine epoch it carries
    2. load each image's encoded bytes (not for a client uuid: the uuid names the image)
    3. hash each image and look it up in the sender cache
    4. decode and process the misses (an image repeated within the request, once)
    5. render: expand the placeholders and place the images; hits travel as their hash alone

Nothing here touches a socket, and the sender cache is only read: the worker commits the
request to it once the request is sent (`SenderCache.commit`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping

from msgspec.structs import replace

from protocol.errors import RequestError
from protocol.messages import EngineRequest, ImageUrl, MMJob
from services.common.stats import Metrics
from services.mm_worker.cache import ImageHasher, ItemInfo, SenderCache
from services.mm_worker.media import MediaPolicy, decode_image, load_image_bytes
from services.mm_worker.render import PreparedImage, check_job, render_request
from services.model import ImageItem, Preprocessor

log = logging.getLogger(__name__)


class JobRenderer:
    """Turns jobs into rendered requests for one model, with one sender cache."""

    def __init__(
        self,
        preprocessor: Preprocessor,
        media: MediaPolicy,
        cache: SenderCache,
        hasher: ImageHasher,
        metrics: Metrics | None = None,
    ) -> None:
        self.preprocessor = preprocessor
        self.metrics = metrics or Metrics("mm-worker", "mm-worker")
        """Where decode and process times go."""
        self.media = media
        self.cache = cache
        self.hasher = hasher
        self._fetches: Mapping[int, concurrent.futures.Future[bytes]] = {}

    def render(
        self, job: MMJob, fetches: Mapping[int, concurrent.futures.Future[bytes]] | None = None,
    ) -> EngineRequest:
        """The job's EngineRequest; raises RequestError (or any error) for this job alone.

        `fetches` holds the started fetches of the job's http(s) images, by image index.
        """
        self._fetches = fetches or {}
        pre = self.preprocessor
        check_job(job, image_token_id=pre.image_token_id, max_context=pre.max_context)
        if self.cache.see_engine_epoch(job.engine_epoch):
            log.info("engine cache epoch %d: sender cache cleared, sender epoch %d",
                     job.engine_epoch, self.cache.epoch)
        loaded = [self._load_for_hash(index, image) for index, image in enumerate(job.images)]
        hashes = [self._hash(image, data) for image, data in zip(job.images, loaded, strict=True)]
        found = self.cache.lookup(hashes, job.mm_cache_invalidate)
        images = self._prepare(job, hashes, found, loaded)
        request = render_request(job, images, pre)
        return replace(request, mm_cache=self.cache.header(job.mm_cache_invalidate))

    def process_image(self, index: int, data: bytes) -> ImageItem:
        """Decode an image's bytes and run the model's image processor on it."""
        started = time.perf_counter()
        image = decode_image(data, index, self.media.max_image_pixels)
        decoded = time.perf_counter()
        try:
            item = self.preprocessor.process_image(image)
        except ValueError as exc:  # HF processors refuse bad sizes (e.g. extreme aspect ratios)
            raise RequestError(
                f"image {index}: the image processor refused it: {exc}", code="invalid_image"
            ) from exc
        processed = time.perf_counter()
        self.metrics.observe("decode", decoded - started)
        self.metrics.observe("process", processed - decoded)
        log.debug(
            "image %d: %dx%d decoded in %.1f ms, processed in %.1f ms (%d tokens)",
            index, image.width, image.height, (decoded - started) * 1e3,
            (processed - decoded) * 1e3, item.num_tokens,
        )
        return item

    # ------------------------------------------------------------ the steps

    def _load_for_hash(self, index: int, image: ImageUrl) -> bytes | None:
        """The encoded bytes, when the hash needs them or the cache is off (else None)."""
        if image.uuid is not None and self._hashing:
            return None
        return load_image_bytes(image.url, index, self.media, self._fetches.get(index))

    def _hash(self, image: ImageUrl, data: bytes | None) -> str:
        if not self._hashing:
            return ""
        if image.uuid is not None:
            return self.hasher.of_uuid(image.uuid)
        assert data is not None
        return self.hasher.of_bytes(data)

    @property
    def _hashing(self) -> bool:
        return self.cache.cache.capacity > 0

    def _prepare(
        self, job: MMJob, hashes: list[str], found: list[ItemInfo | None],
        loaded: list[bytes | None],
    ) -> list[PreparedImage]:
        images: list[PreparedImage] = []
        earlier: dict[str, PreparedImage] = {}
        for index, (mm_hash, info) in enumerate(zip(hashes, found, strict=True)):
            if mm_hash in earlier:  # the same image again: the engine reuses the first one
                images.append(earlier[mm_hash].by_hash())
                continue
            if info is not None:  # a hit: no decode, no processing, only the hash travels
                image = PreparedImage(mm_hash, info.num_tokens, info.nbytes, {})
            else:
                data = loaded[index]
                if data is None:
                    data = load_image_bytes(job.images[index].url, index, self.media,
                                            self._fetches.get(index))
                image = PreparedImage.processed(mm_hash, self.process_image(index, data))
            if mm_hash:
                earlier[mm_hash] = image
            images.append(image)
        return images
