"""From an `MMJob` to the `EngineRequest` the engine runs: the work between the two sockets.

    start(job)     1. check the job (placeholders, length, its videos' sampling)
                   2. load each item's encoded bytes (not for a client uuid: the uuid names it)
                   3. hash each item; guess from the sender cache which ones the engine lacks
                      and start decoding and processing those (an item repeated within the
                      request, once): inline, or in the worker's process pool
    finish(start)  4. note the engine epoch the job carries; look each hash up in the sender
                      cache as it stands now; process any miss the guess did not foresee
                   5. render: expand the placeholders and place the items; hits travel as
                      their hash alone
    render(job)    finish(start(job)), for one job at a time

A job's items are its images, then its videos, numbered in that order (`StartedJob.hashes`,
`work`); errors name each by its own kind's position (`image 1`, `video 0`). A video is decoded
(services/mm_worker/video.py: the frames vLLM's loader keeps, bounded by `VideoLimits`) and
processed (services/model/video.py) in the pool as an image is (`pool.process_video`), or without
one on the calling thread: the worker's video lane.

The worker finishes jobs in the order it started them, each after the commits of all the jobs
before it, so step 4 sees the sender cache exactly as a worker doing one job at a time would:
the guess of step 3 only decides what work starts early, never what is sent. Nothing here
touches a socket, and the sender cache is only read: the worker commits the request to it once
the request is sent (`SenderCache.commit`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from mmlane.common.stats import Metrics
from mmlane.mm_worker.cache import ImageHasher, ItemInfo, SenderCache
from mmlane.mm_worker.media import MediaPolicy, Medium, load_bytes
from mmlane.mm_worker.pool import Processed, ProcessPool, VideoTask, process_image, process_video
from mmlane.mm_worker.render import PreparedItem, check_job, render_request
from mmlane.mm_worker.video import (
    FrameSampling,
    Qwen2VLSampling,
    SmolVLMSampling,
    UniformSampling,
)
from mmlane.model import ImageItem, Preprocessor
from mmlane.model.video import SmolVLMVideo, VideoItem, VideoPreprocessor
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import EngineRequest, ImageUrl, MMJob, VideoSampling

log = logging.getLogger(__name__)

Fetches = Mapping[int, concurrent.futures.Future[bytes]]
"""The started fetches of a job's http(s) images and videos, by item index."""
Item = ImageItem | VideoItem


@dataclass
class StartedJob:
    """A job between `start` and `finish`: its hashes, the bytes loaded for them, and the work
    started for the items the engine was guessed to lack, by item index."""

    job: MMJob
    fetches: Fetches
    hashes: list[str]
    loaded: list[bytes | None]
    work: dict[int, concurrent.futures.Future[Item]]
    sampling: FrameSampling | None = None
    """How its videos' frames are sampled (None: it has none)."""
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


def _let_go(future: concurrent.futures.Future[Item]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().tensors.clear()


@dataclass(frozen=True)
class VideoRendering:
    """What a renderer needs for videos: the model's video processing and their hasher."""

    preprocessor: VideoPreprocessor
    hasher: ImageHasher
    """Scoped to the video processor's settings; each video's sampling goes into its hash."""
    threads: concurrent.futures.Executor | None = None
    """Where videos are decoded and processed without a pool (None: on the calling thread)."""


class JobRenderer:
    """Turns jobs into rendered requests for one model, with one sender cache; images and
    videos (with `video`; None: the model takes none) are processed in `pool` when there is
    one, else on the calling thread."""

    def __init__(
        self,
        preprocessor: Preprocessor,
        media: MediaPolicy,
        cache: SenderCache,
        hasher: ImageHasher,
        metrics: Metrics | None = None,
        pool: ProcessPool | None = None,
        video: VideoRendering | None = None,
    ) -> None:
        self.preprocessor = preprocessor
        self.metrics = metrics or Metrics("mm-worker", "mm-worker")
        """Where decode and process times go."""
        self.media = media
        self.cache = cache
        self.hasher = hasher
        self.pool = pool
        self.video = video

    def render(self, job: MMJob, fetches: Fetches | None = None) -> EngineRequest:
        """The job's EngineRequest; raises RequestError (or any error) for this job alone."""
        return self.finish(self.start(job, fetches))

    def start(self, job: MMJob, fetches: Fetches | None = None) -> StartedJob:
        """Steps 1-3; raises RequestError (or any error) for this job alone."""
        fetches = fetches or {}
        pre = self.preprocessor
        check_job(job, image_token_id=pre.image_token_id, video_token_id=self._video_token_id,
                  max_context=pre.max_context)
        sampling = self._sampling(job)
        loaded = [self._load_for_hash(job, index, fetches) for index in range(_count(job))]
        hashes = [self._hash(job, index, data, sampling) for index, data in enumerate(loaded)]
        held = self.cache.guess(hashes, job.mm_cache_invalidate, job.engine_epoch)
        work: dict[int, concurrent.futures.Future[Item]] = {}
        first: set[str] = set()
        for index, mm_hash in enumerate(hashes):
            if held[index] or mm_hash in first:
                continue
            if mm_hash:
                first.add(mm_hash)
            data = self._bytes(job, index, loaded, fetches)
            work[index] = self._start_item(job, index, data, sampling)
        return StartedJob(job, fetches, hashes, loaded, work, sampling)

    def finish(self, started: StartedJob) -> EngineRequest:
        """Steps 4-5, once the jobs started before this one were committed; raises the error
        of an image that failed (or any error) for this job alone."""
        job = started.job
        self.follow_engine_epoch(job.engine_epoch)
        found = self.cache.lookup(started.hashes, job.mm_cache_invalidate)
        items = self._prepare(started, found)
        request = render_request(job, items, self.preprocessor,
                                 None if self.video is None else self.video.preprocessor)
        return replace(request, mm_cache=self.cache.header(job.mm_cache_invalidate))

    def follow_engine_epoch(self, engine_epoch: int) -> None:
        """Start the sender cache over when `engine_epoch` is newer than the one it mirrors."""
        if self.cache.see_engine_epoch(engine_epoch):
            log.info("engine cache epoch %d: sender cache cleared, sender epoch %d",
                     engine_epoch, self.cache.epoch)

    def process_image(self, index: int, data: bytes) -> Item:
        """Decode an image's bytes and run the model's image processor on it, here."""
        return self._observed(process_image(self.preprocessor, index, data, self.media))

    def process_video(self, task: VideoTask) -> Item:
        """Decode the frames a video's sampling keeps and process them, here."""
        assert self.video is not None  # a job with videos was refused without (`_sampling`)
        return self._observed(process_video(self.video.preprocessor, task, self.media))

    # ------------------------------------------------------------ the steps

    @property
    def _video_token_id(self) -> int | None:
        return None if self.video is None else self.video.preprocessor.video_token_id

    def _sampling(self, job: MMJob) -> FrameSampling | None:
        """How the job's videos are sampled (None: it has none): the rule of the model's
        loader in vLLM with the request's `mm_processor_kwargs`, within the bounds."""
        if not job.videos:
            return None
        if self.video is None:
            raise RequestError(f"this model ({self.preprocessor.family.name} family) takes no "
                               "video", code="invalid_request")
        return video_sampling(job.video_sampling, self.media.video_limits.max_video_frames,
                              self.video.preprocessor)

    def _medium(self, job: MMJob, index: int) -> tuple[Medium, int]:
        """Item `index`'s kind, and its position among the job's items of that kind."""
        if index < len(job.images):
            return self.media.image, index
        return self.media.video, index - len(job.images)

    def _load(self, job: MMJob, index: int, fetches: Fetches) -> bytes:
        medium, position = self._medium(job, index)
        return load_bytes(_source(job, index).url, position, self.media, fetches.get(index),
                          medium)

    def _load_for_hash(self, job: MMJob, index: int, fetches: Fetches) -> bytes | None:
        """The encoded bytes, when the hash needs them or the cache is off (else None)."""
        if _source(job, index).uuid is not None and self._hashing:
            return None
        return self._load(job, index, fetches)

    def _bytes(self, job: MMJob, index: int, loaded: list[bytes | None],
               fetches: Fetches) -> bytes:
        data = loaded[index]
        if data is None:  # named by a uuid: read only when it must be processed
            data = self._load(job, index, fetches)
        return data

    def _hash(self, job: MMJob, index: int, data: bytes | None,
              sampling: FrameSampling | None) -> str:
        if not self._hashing:
            return ""
        source = _source(job, index)
        hasher, settings = self.hasher, ""
        if index >= len(job.images):  # a video: its frames depend on its sampling too
            assert self.video is not None
            hasher, settings = self.video.hasher, repr(sampling)
        if source.uuid is not None:
            return hasher.of_uuid(source.uuid, settings)
        assert data is not None
        return hasher.of_bytes(data, settings)

    @property
    def _hashing(self) -> bool:
        return self.cache.cache.capacity > 0

    def _start_item(self, job: MMJob, index: int, data: bytes,
                    sampling: FrameSampling | None) -> concurrent.futures.Future[Item]:
        """Start processing one item: in the pool, or here and now."""
        if index < len(job.images):
            if self.pool is None:
                return _done(lambda: self.process_image(index, data))
            return self._from_pool(self.pool.submit(index, data))
        assert sampling is not None
        task = VideoTask(index - len(job.images), data, sampling,
                         max_tokens=self.preprocessor.max_context - len(job.prompt_token_ids))
        if self.pool is None:
            assert self.video is not None  # a job with videos was refused without (`_sampling`)
            if self.video.threads is None:
                return _done(lambda: self.process_video(task))
            return self.video.threads.submit(self.process_video, task)
        return self._from_pool(self.pool.submit_video(task))

    def _from_pool(self, processed: concurrent.futures.Future[Processed]
                   ) -> concurrent.futures.Future[Item]:
        """The item of a pool's future, its times observed as it completes."""
        item: concurrent.futures.Future[Item] = concurrent.futures.Future()

        def done(processed: concurrent.futures.Future[Processed]) -> None:
            try:
                item.set_result(self._observed(processed.result()))
            except BaseException as exc:  # the item's error, or its process died
                item.set_exception(exc)

        processed.add_done_callback(done)
        return item

    def _observed(self, processed: Processed) -> Item:
        kind = "video_" if isinstance(processed.item, VideoItem) else ""
        self.metrics.observe(f"{kind}decode", processed.decode_s)
        self.metrics.observe(f"{kind}process", processed.process_s)
        return processed.item

    def _prepare(self, started: StartedJob, found: list[ItemInfo | None]) -> list[PreparedItem]:
        job, hashes = started.job, started.hashes
        items: list[PreparedItem] = []
        earlier: dict[str, PreparedItem] = {}
        for index, (mm_hash, info) in enumerate(zip(hashes, found, strict=True)):
            if mm_hash in earlier:  # the same item again: the engine reuses the first one
                items.append(earlier[mm_hash].by_hash())
                continue
            if info is not None:  # a hit: no decode, no processing, only the hash travels
                item = PreparedItem(mm_hash, info.num_tokens, info.nbytes, {}, info.token_ids)
            else:
                work = started.work.get(index)
                if work is None:  # guessed held, but evicted since: process it now
                    data = self._bytes(job, index, started.loaded, started.fetches)
                    work = self._start_item(job, index, data, started.sampling)
                item = PreparedItem.processed(mm_hash, work.result())
            if mm_hash:
                earlier[mm_hash] = item
            items.append(item)
        return items


def video_sampling(asked: VideoSampling, max_frames: int,
                   video: VideoPreprocessor) -> FrameSampling:
    """The sampling of the model's loader in vLLM (`VideoPreprocessor.loader`, with vLLM's
    defaults) with a request's `fps` and `num_frames`; RequestError naming the field where one
    is out of bounds. However many frames a rate keeps, the decoder refuses more than
    `max_frames` (video_too_large).

    Qwen2-VL's (`qwen2_vl`): frames at `fps`, at most `num_frames` of them, at least one
    temporal patch. The default loader's (`opencv`, LLaVA-OneVision's and InternVL's):
    `num_frames` evenly spaced, or one every 1/`fps` seconds where that keeps fewer, as vLLM's
    `media_io_kwargs` set them (a request's `fps` alone keeps the default 32 frames at
    most). SmolVLM's (transformers' own): frames at `fps`, at most `num_frames`, the model's
    `video_sampling` by default (its most within `max_frames`)."""
    least = video.frame_group
    if asked.fps is not None and not (math.isfinite(asked.fps) and asked.fps > 0):
        raise RequestError(f"mm_processor_kwargs.fps: must be above 0, got {asked.fps:g}")
    if asked.num_frames is not None and not least <= asked.num_frames <= max_frames:
        one = " (one temporal patch)" if least > 1 else ""
        raise RequestError(f"mm_processor_kwargs.num_frames: must be {least}{one} to "
                           f"{max_frames} (max_video_frames), got {asked.num_frames}")
    if video.loader == "qwen2_vl":
        return Qwen2VLSampling(temporal_patch_size=least,
                               **_given(fps=asked.fps, max_frames=asked.num_frames))
    if isinstance(video, SmolVLMVideo):
        return SmolVLMSampling(fps=video.fps if asked.fps is None else asked.fps,
                               max_frames=min(video.max_frames, max_frames)
                               if asked.num_frames is None else asked.num_frames)
    return UniformSampling(**_given(fps=asked.fps, num_frames=asked.num_frames))


def _given(**settings: float | None) -> dict[str, Any]:
    """The settings a request gives (not None)."""
    return {name: value for name, value in settings.items() if value is not None}


def _count(job: MMJob) -> int:
    return len(job.images) + len(job.videos)


def _source(job: MMJob, index: int) -> ImageUrl:
    return job.images[index] if index < len(job.images) else job.videos[index - len(job.images)]


def _done(work: Callable[[], Item]) -> concurrent.futures.Future[Item]:
    """A future of `work` run here and now: its item, or its error."""
    item: concurrent.futures.Future[Item] = concurrent.futures.Future()
    try:
        item.set_result(work())
    except Exception as exc:
        item.set_exception(exc)
    return item
