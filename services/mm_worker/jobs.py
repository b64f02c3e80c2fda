"""From an `MMJob` to the `EngineRequest` the engine runs: the work between the two sockets.

    start(job)     1. check the job (placeholders, length)
                   2. load each image's encoded bytes (not for a client uuid: the uuid names it)
                   3. hash each image; guess from the sender cache which ones the engine lacks
                      and start decoding and processing those (an image repeated within the
                      request, once): inline, or in the worker's process pool
    finish(start)  4. note the engine epoch the job carries; look each hash up in the sender
                      cache as it stands now; process any miss the guess did not foresee
                   5. render: expand the placeholders and place the images; hits travel as
                      their hash alone
    render(job)    finish(start(job)), for one job at a time

The worker finishes jobs in the order it started them, each after the commits of all the jobs
before it, so step 4 sees the sender cache exactly as a worker doing one job at a time would:
the guess of step 3 only decides what work starts early, never what is sent. Nothing here
touches a socket, and the sender cache is only read: the worker commits the request to it once
the request is sent (`SenderCache.commit`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from msgspec.structs import replace

from mmlane.common.stats import Metrics
from mmlane.mm_worker.cache import ImageHasher, ItemInfo, SenderCache
from mmlane.mm_worker.media import MediaPolicy, load_image_bytes
from mmlane.mm_worker.pool import Processed, ProcessPool, process_image
from mmlane.mm_worker.render import PreparedImage, check_job, render_request
from mmlane.model import ImageItem, Preprocessor
from mmlane.protocol.messages import EngineRequest, ImageUrl, MMJob

log = logging.getLogger(__name__)

Fetches = Mapping[int, concurrent.futures.Future[bytes]]
"""The started fetches of a job's http(s) images, by image index."""


@dataclass
class StartedJob:
    """A job between `start` and `finish`: its hashes, the bytes loaded for them, and the image
    work started for the images the engine was guessed to lack, by image index."""

    job: MMJob
    fetches: Fetches
    hashes: list[str]
    loaded: list[bytes | None]
    work: dict[int, concurrent.futures.Future[ImageItem]]
    received_at: float = 0.0
    """When the worker took the job off its socket (`time.monotonic()`)."""

    def ready(self) -> bool:
        return all(future.done() for future in self.work.values())

    def drop(self) -> None:
        """The job ends unsent: cancel its image work not yet running, and let go of the
        pixels of the rest as soon as each is done (a pool process's slot is freed then, not
        whenever a garbage collection reaches a traceback that holds the job)."""
        for future in self.work.values():
            future.cancel()
            future.add_done_callback(_let_go)


def _let_go(future: concurrent.futures.Future[ImageItem]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().tensors.clear()


class JobRenderer:
    """Turns jobs into rendered requests for one model, with one sender cache; images are
    processed in `pool` when there is one, else on the calling thread."""

    def __init__(
        self,
        preprocessor: Preprocessor,
        media: MediaPolicy,
        cache: SenderCache,
        hasher: ImageHasher,
        metrics: Metrics | None = None,
        pool: ProcessPool | None = None,
    ) -> None:
        self.preprocessor = preprocessor
        self.metrics = metrics or Metrics("mm-worker", "mm-worker")
        """Where decode and process times go."""
        self.media = media
        self.cache = cache
        self.hasher = hasher
        self.pool = pool

    def render(self, job: MMJob, fetches: Fetches | None = None) -> EngineRequest:
        """The job's EngineRequest; raises RequestError (or any error) for this job alone."""
        return self.finish(self.start(job, fetches))

    def start(self, job: MMJob, fetches: Fetches | None = None) -> StartedJob:
        """Steps 1-3; raises RequestError (or any error) for this job alone."""
        fetches = fetches or {}
        pre = self.preprocessor
        check_job(job, image_token_id=pre.image_token_id, max_context=pre.max_context)
        loaded = [self._load_for_hash(index, image, fetches)
                  for index, image in enumerate(job.images)]
        hashes = [self._hash(image, data) for image, data in zip(job.images, loaded, strict=True)]
        held = self.cache.guess(hashes, job.mm_cache_invalidate, job.engine_epoch)
        work: dict[int, concurrent.futures.Future[ImageItem]] = {}
        first: set[str] = set()
        for index, mm_hash in enumerate(hashes):
            if held[index] or mm_hash in first:
                continue
            if mm_hash:
                first.add(mm_hash)
            work[index] = self._start_image(index, self._bytes(job, index, loaded, fetches))
        return StartedJob(job, fetches, hashes, loaded, work)

    def finish(self, started: StartedJob) -> EngineRequest:
        """Steps 4-5, once the jobs started before this one were committed; raises the error
        of an image that failed (or any error) for this job alone."""
        job = started.job
        self.follow_engine_epoch(job.engine_epoch)
        found = self.cache.lookup(started.hashes, job.mm_cache_invalidate)
        images = self._prepare(started, found)
        request = render_request(job, images, self.preprocessor)
        return replace(request, mm_cache=self.cache.header(job.mm_cache_invalidate))

    def follow_engine_epoch(self, engine_epoch: int) -> None:
        """Start the sender cache over when `engine_epoch` is newer than the one it mirrors."""
        if self.cache.see_engine_epoch(engine_epoch):
            log.info("engine cache epoch %d: sender cache cleared, sender epoch %d",
                     engine_epoch, self.cache.epoch)

    def process_image(self, index: int, data: bytes) -> ImageItem:
        """Decode an image's bytes and run the model's image processor on it, here."""
        return self._observed(process_image(self.preprocessor, index, data, self.media))

    # ------------------------------------------------------------ the steps

    def _load_for_hash(self, index: int, image: ImageUrl, fetches: Fetches) -> bytes | None:
        """The encoded bytes, when the hash needs them or the cache is off (else None)."""
        if image.uuid is not None and self._hashing:
            return None
        return load_image_bytes(image.url, index, self.media, fetches.get(index))

    def _bytes(self, job: MMJob, index: int, loaded: list[bytes | None],
               fetches: Fetches) -> bytes:
        data = loaded[index]
        if data is None:  # named by a uuid: read only when it must be processed
            data = load_image_bytes(job.images[index].url, index, self.media, fetches.get(index))
        return data

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

    def _start_image(self, index: int, data: bytes) -> concurrent.futures.Future[ImageItem]:
        """Start processing one image: in the pool, or here and now."""
        item: concurrent.futures.Future[ImageItem] = concurrent.futures.Future()
        if self.pool is None:
            try:
                item.set_result(self.process_image(index, data))
            except Exception as exc:
                item.set_exception(exc)
            return item

        def done(processed: concurrent.futures.Future[Processed]) -> None:
            try:
                item.set_result(self._observed(processed.result()))
            except BaseException as exc:  # the image's error, or its process died
                item.set_exception(exc)

        self.pool.submit(index, data).add_done_callback(done)
        return item

    def _observed(self, processed: Processed) -> ImageItem:
        self.metrics.observe("decode", processed.decode_s)
        self.metrics.observe("process", processed.process_s)
        return processed.item

    def _prepare(self, started: StartedJob, found: list[ItemInfo | None]) -> list[PreparedImage]:
        job, hashes = started.job, started.hashes
        images: list[PreparedImage] = []
        earlier: dict[str, PreparedImage] = {}
        for index, (mm_hash, info) in enumerate(zip(hashes, found, strict=True)):
            if mm_hash in earlier:  # the same image again: the engine reuses the first one
                images.append(earlier[mm_hash].by_hash())
                continue
            if info is not None:  # a hit: no decode, no processing, only the hash travels
                image = PreparedImage(mm_hash, info.num_tokens, info.nbytes, {}, info.token_ids)
            else:
                work = started.work.get(index)
                if work is None:  # guessed held, but evicted since: process it now
                    data = self._bytes(job, index, started.loaded, started.fetches)
                    work = self._start_image(index, data)
                image = PreparedImage.processed(mm_hash, work.result())
            if mm_hash:
                earlier[mm_hash] = image
            images.append(image)
        return images
