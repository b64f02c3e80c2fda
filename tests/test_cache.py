"""The mirrored feature cache, piece by piece, in-process (the whole system: test_cache_*.py).

    TestFeatureCache    LRU by bytes; commit's three steps; items larger than the cache
    TestMMHash          what an image's hash covers, blake3 and sha256
    TestSenderCache     epochs: in use only once an engine epoch is known; a newer one clears
    TestReceiverCaches  the sync rules: in sync, out of sync, stale or new sender, lost messages
    TestJobRenderer     a hit skips decoding and processing; uuids; an image repeated in a request
    TestWire            the new messages and fields round-trip; a hit travels without frames
"""

from __future__ import annotations

import numpy as np
import pytest
from msgspec.structs import replace

from bench.images import noise_image, png_uri
from mmlane.common.config import load_config
from mmlane.common.feature_cache import FeatureCache, capacity_bytes, commit
from mmlane.engine.cache import ReceiverCaches
from mmlane.engine.config import EngineConfig
from mmlane.mm_worker.cache import ImageHasher, SenderCache
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.mm_worker.jobs import JobRenderer
from mmlane.mm_worker.media import MediaPolicy
from mmlane.model import ImageItem
from mmlane.protocol.codec import Codec
from mmlane.protocol.errors import CacheMissError, FatalError, RetryableError, from_info
from mmlane.protocol.messages import (
    EngineInput,
    EngineRequest,
    ImageUrl,
    MMCacheHeader,
    MMItem,
    MMJob,
    MMWorkerInput,
    SamplingParams,
)

SAMPLING = SamplingParams(max_tokens=1)


def item(mm_hash: str, nbytes: int, *, carried: bool = True, fill: int = 0) -> MMItem:
    tensors = {"pixel_values": np.full(nbytes, fill, np.uint8)} if carried else {}
    return MMItem(offset=0, length=1, tensors=tensors, mm_hash=mm_hash, nbytes=nbytes)


def request(*items: MMItem, header: MMCacheHeader | None = None, rid: str = "r") -> EngineRequest:
    return EngineRequest(request_id=rid, reply_to="ipc://f", prompt_token_ids=[1],
                         sampling=SAMPLING, mm_items=list(items), mm_cache=header)


def header(seq: int, *, engine: int, sender_epoch: int = 10, capacity: int = 100,
           sender: str = "w", invalidate: tuple[str, ...] = ()) -> MMCacheHeader:
    return MMCacheHeader(sender=sender, sender_epoch=sender_epoch, engine_epoch=engine, seq=seq,
                         capacity=capacity, invalidate=list(invalidate))


def keys(cache: FeatureCache) -> list[str]:
    return [key for key, _ in cache.entries()]


class TestFeatureCache:
    def test_evicts_least_recently_used_by_bytes(self) -> None:
        cache: FeatureCache[str] = FeatureCache(10)
        for key, size in [("a", 4), ("b", 3), ("c", 3)]:
            cache.put(key, size, key)
        cache.touch("a")
        cache.put("d", 4, "d")  # 14 bytes: b, then c go (the least recently used first)
        assert cache.entries() == [("a", 4), ("d", 4)]
        assert (cache.nbytes, cache.evictions) == (8, 2)

    def test_an_item_larger_than_the_cache_is_never_cached(self) -> None:
        cache: FeatureCache[str] = FeatureCache(10)
        cache.put("a", 6, "a")
        assert not cache.put("big", 11, "big")
        assert cache.entries() == [("a", 6)]  # and nothing was evicted for it

    def test_replacing_a_key_counts_its_bytes_once(self) -> None:
        cache: FeatureCache[str] = FeatureCache(10)
        cache.put("a", 6, "a")
        cache.put("a", 7, "a2")
        assert (cache.entries(), cache.get("a"), cache.nbytes) == ([("a", 7)], "a2", 7)

    def test_commit_touches_every_hash_before_inserting_any(self) -> None:
        cache: FeatureCache[str] = FeatureCache(10)
        cache.put("old", 4, "old")
        cache.put("mid", 4, "mid")
        # "old" is referenced and "new" inserted: touching first keeps "old" and evicts "mid".
        held = commit(cache, request(item("old", 4, carried=False), item("new", 5)),
                      lambda i: i.mm_hash)
        assert held == {"old": "old"}
        assert keys(cache) == ["old", "new"]

    def test_commit_hands_back_what_it_then_evicts(self) -> None:
        cache: FeatureCache[str] = FeatureCache(10)
        cache.put("a", 6, "a")
        held = commit(cache, request(item("a", 6, carried=False), item("b", 7)),
                      lambda i: i.mm_hash)
        assert held == {"a": "a"}  # the request still gets it, though the insert evicted it
        assert keys(cache) == ["b"]

    def test_commit_drops_invalidated_hashes_first(self) -> None:
        cache: FeatureCache[str] = FeatureCache(10)
        cache.put("a", 2, "stale")
        held = commit(cache, request(item("a", 2), header=header(0, engine=1, invalidate=["a"])),
                      lambda i: "fresh")
        assert held == {} and cache.get("a") == "fresh"

    @pytest.mark.parametrize(("gb", "expected"), [(0, 0), (0.5, 1 << 29), (4, 4 << 30)])
    def test_capacity_is_in_gib(self, gb: float, expected: int) -> None:
        assert capacity_bytes(gb) == expected


class TestMMHash:
    def test_same_bytes_same_hash_and_every_input_counts(self) -> None:
        hasher = ImageHasher("blake3", "tiny", {"size": 1})
        first = hasher.of_bytes(b"jpeg")
        assert first == ImageHasher("blake3", "tiny", {"size": 1}).of_bytes(b"jpeg")
        assert len(first) == 64 and int(first, 16) >= 0
        assert len({
            first,
            hasher.of_bytes(b"jpeg!"),
            ImageHasher("blake3", "other-model", {"size": 1}).of_bytes(b"jpeg"),
            ImageHasher("blake3", "tiny", {"size": 2}).of_bytes(b"jpeg"),
            ImageHasher("sha256", "tiny", {"size": 1}).of_bytes(b"jpeg"),
            hasher.of_uuid("jpeg"),
        }) == 6

    def test_unknown_algorithm_is_refused_at_startup(self) -> None:
        with pytest.raises(FatalError, match="mm_hash"):
            load_config(MMWorkerConfig, {"mm_hash": "md5"})

    @pytest.mark.parametrize("config", [MMWorkerConfig, EngineConfig])
    @pytest.mark.parametrize("value", [-1, float("nan")])
    def test_bad_capacity_is_refused_naming_the_setting(self, config: type, value: float) -> None:
        with pytest.raises(FatalError, match="mm_cache_gb must be a number >= 0"):
            load_config(config, {"mm_cache_gb": value})


class TestSenderCache:
    def test_not_in_use_until_an_engine_epoch_is_known(self) -> None:
        sender = SenderCache("w", 100)
        assert not sender.in_use
        assert sender.lookup(["a"], []) == [None] and sender.header([]) is None
        assert sender.see_engine_epoch(5) and sender.in_use

    def test_a_newer_engine_epoch_clears_it_and_starts_a_larger_sender_epoch(self) -> None:
        sender = SenderCache("w", 100)
        sender.see_engine_epoch(5)
        first = sender.epoch
        sender.commit(request(item("a", 10), header=sender.header([])))
        assert keys(sender.cache) == ["a"] and sender.seq == 1
        assert not sender.see_engine_epoch(0)  # the frontend knows none yet
        assert not sender.see_engine_epoch(4)  # a frontend behind the news
        assert keys(sender.cache) == ["a"]
        assert sender.see_engine_epoch(6)
        assert (keys(sender.cache), sender.seq) == ([], 0) and sender.epoch > first

    def test_invalidated_hashes_are_looked_up_as_misses(self) -> None:
        sender = SenderCache("w", 100)
        sender.see_engine_epoch(5)
        sender.commit(request(item("a", 10), item("b", 10), header=sender.header([])))
        assert [info is not None for info in sender.lookup(["a", "b"], ["b"])] == [True, False]

    def test_off_at_zero_capacity(self) -> None:
        sender = SenderCache("w", 0)
        sender.see_engine_epoch(5)
        assert not sender.in_use and sender.header([]) is None


class TestReceiverCaches:
    def test_in_sync_hash_only_items_get_their_tensors(self) -> None:
        engine = ReceiverCaches(100)
        engine.receive(request(item("a", 10, fill=7), header=header(0, engine=engine.epoch)))
        got = engine.receive(request(item("a", 10, carried=False),
                                     header=header(1, engine=engine.epoch)))
        assert (got.mm_items[0].tensors["pixel_values"] == 7).all()
        assert engine.counters["cache_hits"] == 1 and engine.entries("w") == [("a", 10)]

    def test_a_sender_behind_our_epoch_changes_nothing_and_a_hit_is_a_miss(self) -> None:
        engine = ReceiverCaches(100)
        stale = header(0, engine=engine.epoch - 1)
        served = engine.receive(request(item("a", 10), header=stale))
        assert served.mm_items[0].tensors and engine.entries("w") == []
        with pytest.raises(CacheMissError) as caught:
            engine.receive(request(item("a", 10, carried=False), item("b", 5),
                                   header=replace(stale, seq=1)))
        assert caught.value.mm_hashes == ["a", "b"]  # every hash: the resend carries them all
        assert engine.counters["cache_unsynced"] == 2
        assert engine.counters["cache_desyncs"] == 0

    def test_a_restarted_sender_drops_its_receiver_cache(self) -> None:
        engine = ReceiverCaches(100)
        engine.receive(request(item("a", 10), header=header(0, engine=engine.epoch)))
        engine.receive(request(item("b", 10), header=header(0, engine=engine.epoch,
                                                            sender_epoch=11)))
        assert engine.entries("w") == [("b", 10)] and engine.sender_epoch("w") == 11
        assert engine.counters["cache_sender_restarts"] == 1

    def test_late_messages_of_a_restarted_sender_are_served_uncached(self) -> None:
        engine = ReceiverCaches(100)
        engine.receive(request(item("b", 10), header=header(0, engine=engine.epoch,
                                                            sender_epoch=11)))
        late = request(item("a", 10), header=header(3, engine=engine.epoch, sender_epoch=10))
        assert engine.receive(late).mm_items[0].tensors
        assert engine.entries("w") == [("b", 10)] and engine.sender_epoch("w") == 11
        assert engine.counters["cache_stale_sender"] == 1
        assert engine.counters["cache_desyncs"] == 0

    @pytest.mark.parametrize("seq", [2, 0])
    def test_a_lost_message_starts_a_new_engine_epoch(self, seq: int) -> None:
        engine = ReceiverCaches(100)
        first = engine.epoch
        engine.receive(request(item("a", 10), header=header(0, engine=first)))
        engine.receive(request(item("a", 10), header=header(seq, engine=first)))
        assert engine.counters["cache_desyncs"] == 1
        assert engine.epoch > first and engine.entries("w") == []

    def test_a_dangling_hash_in_sync_starts_a_new_engine_epoch(self) -> None:
        engine = ReceiverCaches(100)
        first = engine.epoch
        with pytest.raises(CacheMissError, match="does not hold 1 cached image"):
            engine.receive(request(item("a", 10, carried=False), header=header(0, engine=first)))
        assert engine.counters["cache_desyncs"] == 1 and engine.epoch > first

    def test_a_sender_knowing_a_newer_engine_epoch_moves_ours_past_it(self) -> None:
        engine = ReceiverCaches(100)
        ahead = engine.epoch + 1000  # our clock went back across a restart
        engine.receive(request(item("a", 10), header=header(0, engine=ahead)))
        assert engine.epoch > ahead and engine.counters["cache_desyncs"] == 1

    def test_a_sender_cache_larger_than_ours_is_not_mirrored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        engine = ReceiverCaches(50)
        engine.receive(request(item("a", 10), header=header(0, engine=engine.epoch)))
        assert engine.entries("w") == [] and engine.counters["cache_desyncs"] == 0
        assert "same --mm-cache-gb" in caplog.text

    def test_an_image_repeated_in_one_request_travels_once(self) -> None:
        engine = ReceiverCaches(0)  # even with the cache off
        got = engine.receive(request(item("a", 10, fill=3), item("a", 10, carried=False)))
        assert (got.mm_items[1].tensors["pixel_values"] == 3).all()

    def test_reset_starts_a_new_epoch_without_receiver_caches(self) -> None:
        engine = ReceiverCaches(100)
        engine.receive(request(item("a", 10), header=header(0, engine=engine.epoch)))
        first = engine.epoch
        assert engine.reset() > first and engine.entries("w") == []


class CountingRenderer(JobRenderer):
    processed = 0

    def process_image(self, index: int, data: bytes) -> ImageItem:
        self.processed += 1
        return super().process_image(index, data)


class TestJobRenderer:
    @pytest.fixture
    def renderer(self, qwen_dir) -> CountingRenderer:
        return self.renderer_of(qwen_dir)

    @staticmethod
    def renderer_of(model_dir) -> CountingRenderer:
        from mmlane.model import load_preprocessor

        pre = load_preprocessor(model_dir)
        cache = SenderCache("w", 1 << 30)
        cache.see_engine_epoch(1)
        media = MediaPolicy(allowed_media_dir=None, max_image_bytes=1 << 24,
                            max_image_pixels=1 << 24)
        hasher = ImageHasher("blake3", pre.model_id, pre.image_processor.to_dict())
        return CountingRenderer(pre, media, cache, hasher)

    def job(self, renderer: JobRenderer, *images: ImageUrl) -> MMJob:
        pre = renderer.preprocessor
        prompt = [1] + [pre.image_token_id, 2] * len(images)
        return MMJob(request_id="r", reply_to="ipc://f", prompt_token_ids=prompt,
                     images=list(images), sampling=SAMPLING, engine_epoch=1)

    def test_a_hit_skips_decoding_and_processing(self, renderer: CountingRenderer) -> None:
        image = ImageUrl(url=png_uri(noise_image(56, 56)))
        first = renderer.render(self.job(renderer, image))
        renderer.cache.commit(first)
        second = renderer.render(self.job(renderer, image))
        assert renderer.processed == 1
        assert second.mm_items[0].tensors == {}
        assert second.mm_items[0].mm_hash == first.mm_items[0].mm_hash
        assert (second.mm_items[0].nbytes, second.prompt_token_ids) == (
            first.mm_items[0].nbytes, first.prompt_token_ids)

    def test_a_hit_places_the_images_own_span_again(self, model_dirs) -> None:
        """Mistral 3's span (rows of [IMG], [IMG_BREAK], [IMG_END]) comes back from P0."""
        renderer = self.renderer_of(model_dirs["mistral3"])
        image = ImageUrl(url=png_uri(noise_image(100, 60)))
        first = renderer.render(self.job(renderer, image))
        renderer.cache.commit(first)
        second = renderer.render(self.job(renderer, image))
        assert renderer.processed == 1 and second.mm_items[0].tensors == {}
        span = first.mm_items[0]
        assert len(set(first.prompt_token_ids[span.offset : span.offset + span.length])) == 3
        assert second.prompt_token_ids == first.prompt_token_ids

    def test_a_uuid_hit_does_not_even_read_the_image(self, renderer: CountingRenderer) -> None:
        good = ImageUrl(url=png_uri(noise_image(56, 56)), uuid="cat-1")
        renderer.cache.commit(renderer.render(self.job(renderer, good)))
        unreadable = ImageUrl(url="file:///nowhere/cat.png", uuid="cat-1")
        assert renderer.render(self.job(renderer, unreadable)).mm_items[0].tensors == {}

    def test_an_image_repeated_in_one_request_is_processed_once(
        self, renderer: CountingRenderer
    ) -> None:
        image = ImageUrl(url=png_uri(noise_image(56, 56)))
        rendered = renderer.render(self.job(renderer, image, image))
        assert renderer.processed == 1
        assert [bool(i.tensors) for i in rendered.mm_items] == [True, False]

    def test_an_invalidated_hit_is_processed_again(self, renderer: CountingRenderer) -> None:
        image = ImageUrl(url=png_uri(noise_image(56, 56)))
        first = renderer.render(self.job(renderer, image))
        renderer.cache.commit(first)
        job = replace(self.job(renderer, image), mm_cache_invalidate=[first.mm_items[0].mm_hash])
        again = renderer.render(job)
        assert renderer.processed == 2 and again.mm_items[0].tensors
        assert again.mm_cache is not None and again.mm_cache.invalidate == job.mm_cache_invalidate


class TestWire:
    def test_a_hit_travels_without_tensor_frames(self) -> None:
        codec: Codec[EngineRequest] = Codec(EngineInput)
        hit = request(item("a", 10, carried=False), header=header(3, engine=9, invalidate=["x"]))
        frames = codec.encode(hit)
        assert len(frames) == 1
        assert codec.decode(frames) == hit

    def test_jobs_carry_the_engine_epoch_and_invalidations(self) -> None:
        codec: Codec[MMJob] = Codec(MMWorkerInput)
        job = MMJob(request_id="r", reply_to="ipc://f", prompt_token_ids=[1],
                    images=[ImageUrl(url="data:,", uuid="u")], sampling=SAMPLING,
                    engine_epoch=7, mm_cache_invalidate=["a"])
        assert codec.decode(codec.encode(job)) == job

    def test_a_cache_miss_crosses_as_data_with_its_hashes(self) -> None:
        error = from_info(CacheMissError("gone", mm_hashes=["a", "b"]).to_info())
        assert isinstance(error, CacheMissError) and isinstance(error, RetryableError)
        assert (error.code, error.mm_hashes) == ("cache_miss", ["a", "b"])
