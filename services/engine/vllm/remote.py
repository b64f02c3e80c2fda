"""The "vllm-remote" backend's runner: rendered requests to vLLM servers people already run.

Each request goes to a replica's scale-out API (`vllm serve --enable-scale-out`): `POST
/inference/v1/generate` with the prompt's token ids and, for a request with images or videos
(vLLM 0.32's generate API takes a "video" modality beside "image" in `features`; the
families wire.py writes), `features`: mmlane's hash of each item (`mm_hashes`, so a repeated
image or video hits the replica's encoder and prefix caches), its placeholder range, and its
tensors in full, as vLLM's own item encoding (services/engine/wire.py); an item the replica's
engine core holds (vLLM's P1, which `Replica.images` mirrors, images and videos alike, as
vLLM's own processor cache does) goes as its hash alone. The reply
streams back as server-sent events of new token ids (`output_mode` tokens: the frontend
detokenizes). Nothing here imports vLLM.

The requests run on this process's `vllm-remote` thread, an asyncio loop with one HTTP client
session (loop.py). Cancelling a request closes its stream, and vLLM aborts it when
its client goes away. A replica is picked by affinity (the first image's hash, else the
prompt's first tokens; rendezvous hashing, so a replica's coming or going moves only its own
share), so a repeated image or system prompt reaches the replica that holds it, unless that one
holds far more requests than the mean. Each replica's `/health` is checked every 2 s while it
is up, less and less often while it is down; a down replica gets no requests while another is
up, and a request whose replica fails before its first token is sent to another one, once. A
replica that stops answering (stopped, hung: it still accepts connections) fails its health
check; then each request on it that has heard nothing from it while the check went unanswered
(or ever) fails as a broken stream would, so none waits for its deadline. Each replica's
state, outstanding requests and errors are in the stats.

Errors: a replica's 4xx is the request's fault (RequestError with vLLM's message; a 413, a
body limit in front of the replica, as request_too_large naming the body's size), a 5xx, a
broken stream or an unreachable replica a retryable one; an error chunk in the stream ends the
request with vLLM's message. A body over --remote-max-body-mb is refused before it is sent.

Text first: with `--remote-priority` (the replicas run `--scheduling-policy priority`), text
goes ahead of images in each replica's queue; with `--encoder-lane` (lane.py), images' vision
passes run here and the replicas get their embeddings in place of pixels (vLLM 0.32's
scale-out API takes them without `--enable-mm-embeds`), so no replica's step runs a vision
encoder for an image. Videos go as pixels even then: the replica runs their vision pass.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import transformers

from mmlane.common.feature_cache import FeatureCache, capacity_bytes
from mmlane.common.prometheus import exposition, labelled, vllm_series
from mmlane.common.stats import Metrics
from mmlane.engine import wire
from mmlane.engine.config import EngineConfig, VisionConfig
from mmlane.engine.runner import ModelSpec, StepOutput
from mmlane.engine.vision import VisionEncoder
from mmlane.engine.vllm.lane import EncoderLane, load_lane
from mmlane.engine.vllm.loop import FINISH_REASONS, LoopRunner, refusal
from mmlane.model import load_preprocessor, resolve_model_dir
from mmlane.model.video import videos_of
from mmlane.protocol.errors import (
    FatalError,
    MMLaneError,
    RequestError,
    RetryableError,
    translate,
)
from mmlane.protocol.messages import EngineRequest, TokenLogprobs

log = logging.getLogger(__name__)

AFFINITY_TOKENS = 64
"""A text request's replica is chosen by a hash of its first tokens (its system prompt)."""
LOAD_SLACK = 1.5
"""A request's own replica is passed over while it holds more than this times the mean of the
replicas' outstanding requests (plus one)."""
RETRIES = 1
"""How many other replicas a request that failed before its first token is sent to."""
HEALTH_INTERVAL_S = 2.0
"""Seconds between a replica's health checks (`GET /health`) while it is up."""
HEALTH_BACKOFF_S = 30.0
"""The longest wait between a down replica's health checks (doubled from the interval)."""
HEALTH_TIMEOUT_S = 5.0
DRIFTS_IN_A_ROW = 3
"""After this many requests in a row for which a replica lacked an image the mirror said it
held, its images go in full: it keeps no image cache to mirror."""


@dataclass
class Replica:
    """One vLLM server, as the runner sees it."""

    url: str
    up: bool = True
    """Whether it answered its last health check (and no request since found it failing)."""
    outstanding: int = 0
    """Requests sent to it and not yet ended."""
    errors: int = 0
    """Requests it failed (unreachable, 5xx, a broken stream)."""
    check_every_s: float = HEALTH_INTERVAL_S
    """How long until its next health check: doubled while it is down, up to HEALTH_BACKOFF_S."""
    metrics: str = ""
    """vLLM's `vllm:` series from its /metrics, as of its last health check while up."""
    images: FeatureCache[bool] = field(default_factory=lambda: FeatureCache(0))
    """The images and videos its engine core's cache (vLLM's P1) holds, by hash and size, as
    mmlane's requests went through it (--remote-mm-cache-gb: 0 sends every item in full)."""
    drifts: int = 0
    """Requests in a row that it lacked an image for that the mirror said it held."""
    attempts: set[_Attempt] = field(default_factory=set)
    """The requests on it now."""

    def failed(self) -> None:
        self.errors += 1
        self.up = False


class RemoteVLLMRunner(LoopRunner):
    """Runs requests on remote vLLM replicas (see the module docstring)."""

    def __init__(self, urls: list[str], spec: ModelSpec,
                 metrics: Metrics, *, priority: bool, encoder: VisionEncoder | None = None,
                 vision: VisionConfig | None = None, mm_cache_bytes: int = 0,
                 max_body_bytes: int = 0) -> None:
        self._replicas = [Replica(url, images=FeatureCache(mm_cache_bytes))
                          for url in dict.fromkeys(u.rstrip("/") for u in urls)]
        self._max_body_bytes = max_body_bytes
        """The replicas' body limit (--remote-max-body-mb; 0: none known)."""
        self.spec = spec
        self.metrics = metrics
        self._priority = priority
        super().__init__("vllm-remote")
        self._lane = None if encoder is None else EncoderLane(
            encoder, spec.image_token_id, vision or VisionConfig(), self._loop, metrics)
        self._session: Any = self._call(self._open())
        for replica in self._replicas:
            self._loop.call_soon_threadsafe(self._watch, replica)
            self._publish(replica)
        self._exposition = ""
        """The replicas' vLLM series, each labelled with its replica: made again on the loop
        thread when a scrape changes one, read as it is by the stats thread."""
        metrics.exposition = lambda: self._exposition

    def _publish(self, replica: Replica) -> None:
        """Its state in the stats (health, top, /metrics)."""
        self.metrics.gauge(f"replica_outstanding:{replica.url}", lambda: replica.outstanding)
        self.metrics.gauge(f"replica_up:{replica.url}", lambda: int(replica.up))
        self.metrics.gauge(f"replica_errors:{replica.url}", lambda: replica.errors)

    async def _open(self) -> Any:
        import aiohttp

        # No limit of our own on connections: the engine's queue bounds the requests.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None))

    def close(self) -> None:
        """Close the HTTP session (what is in flight is cancelled), the vision lane and the
        loop thread."""
        self._call(self._session.close())
        if self._lane is not None:
            self._lane.close()
        self._stop_loop()

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self._replicas]


    # ------------------------------------------------------------ on the loop thread

    def _watch(self, replica: Replica) -> None:
        self._loop.create_task(self._check(replica))

    async def _check(self, replica: Replica) -> None:
        """Its health check, then the next one: soon while it is up, later and later while it
        is down."""
        import aiohttp

        if self._session.closed:
            return
        was_up, scraped = replica.up, replica.metrics
        asked = self._loop.time()
        try:
            async with self._session.get(
                f"{replica.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as reply:
                replica.up = reply.status == 200
            if replica.up:
                replica.metrics = await self._vllm_metrics(replica)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            replica.up = False
        if not replica.up:
            replica.metrics = ""  # no stale series of a replica that is down
            self._end_silent(replica, asked)
        if replica.metrics != scraped:
            self._exposition = exposition(labelled(
                ({"replica": other.url}, other.metrics)
                for other in self._replicas if other.metrics))
        if replica.up != was_up:
            log.warning("vLLM replica %s is %s", replica.url, "up" if replica.up else "down")
        replica.check_every_s = (HEALTH_INTERVAL_S if replica.up
                                 else min(2 * replica.check_every_s, HEALTH_BACKOFF_S))
        self._loop.call_later(replica.check_every_s, self._watch, replica)

    def _end_silent(self, replica: Replica, asked: float) -> None:
        """End each request on `replica`, found down by the health check sent at `asked`, that
        has heard nothing from it at all, or nothing since then and for HEALTH_TIMEOUT_S (a
        replica stopped or hung accepts connections and answers nothing): it fails as if its
        stream broke, and moves to another replica if it had no token yet. One whose tokens
        still flow is left to finish."""
        now = self._loop.time()
        since = min(asked, now - HEALTH_TIMEOUT_S)
        for attempt in [a for a in replica.attempts if a.heard is None or a.heard <= since]:
            replica.attempts.discard(attempt)
            attempt.bound.reschedule(now)  # its TimeoutError, in _run

    async def _vllm_metrics(self, replica: Replica) -> str:
        import aiohttp

        async with self._session.get(
            f"{replica.url}/metrics", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        ) as reply:
            return vllm_series(await reply.text()) if reply.status == 200 else ""

    async def _run(self, handle: int, request: EngineRequest) -> None:
        """(Cancelled, its stream closes: vLLM aborts the request.) A request whose replica
        fails before its first token goes to another replica, once."""
        embeds = None
        if self._lane is not None and request.mm_items:
            try:  # the images': videos go as pixels
                embeds = await self._lane.embeddings(request, wire.image_indices(request))
            except MMLaneError as exc:
                self._outputs.put(StepOutput(handle, [], error=exc))
                return
        try:  # once, however many replicas it goes to
            images = _Images(request, wire.item_tensors(request, self.spec, embeds),
                             embeds=embeds is not None)
        except Exception as exc:  # ours to fix, not a replica's failure: it is not sent
            self._outputs.put(StepOutput(handle, [], error=translate(
                exc, "cannot encode the request for vLLM", default="internal")))
            return
        tried: list[Replica] = []
        while True:
            replica = self._pick(request, tried)
            tried.append(replica)
            started = False
            replica.outstanding += 1
            attempt = _Attempt()
            replica.attempts.add(attempt)
            try:
                async with asyncio.timeout(None) as attempt.bound:  # due when it is given up
                    async for output in self._stream(handle, request, images, replica, attempt):
                        started = True
                        self._outputs.put(output)
                return
            except asyncio.CancelledError:
                if not started:  # it may never have reached the replica's engine core
                    images.forget(replica)
                raise
            except Exception as exc:
                if not started:
                    images.forget(replica)
                error = exc if isinstance(exc, MMLaneError) else RetryableError(
                    f"vLLM replica {replica.url} failed: {type(exc).__name__}: {exc}",
                    code="backend_unavailable")
                if attempt.bound.expired():
                    error = RetryableError(
                        f"vLLM replica {replica.url} stopped answering: its health check "
                        f"failed, and the request heard nothing from it meanwhile",
                        code="backend_unavailable")
                if error.code != "backend_unavailable":  # the request's own failure
                    self._outputs.put(StepOutput(handle, [], error=error))
                    return
                replica.failed()
                if started or len(tried) > RETRIES or len(tried) == len(self._replicas):
                    self._outputs.put(StepOutput(handle, [], error=error))
                    return
                log.warning("request %s: %s; sending it to another replica",
                            request.request_id, error.message)
            finally:
                replica.outstanding -= 1
                replica.attempts.discard(attempt)

    async def _stream(self, handle: int, request: EngineRequest, images: _Images,
                      replica: Replica, attempt: _Attempt) -> AsyncIterator[StepOutput]:
        """The request's outputs from `replica`, its images sent as their hashes where the
        replica's engine core holds them (`Replica.images`). If the core lacks one after all
        (its cache and the mirror drifted: another client's images, a restart), vLLM ends the
        request with an error before any token; it is sent again, once, in full. After
        DRIFTS_IN_A_ROW such resends with no image found between them, the replica is taken to
        keep no such cache, and gets every image in full from then on."""
        held = images.held_by(replica)
        hash_only = any(held)
        self.metrics.counters["remote_mm_items_sent"] += len(held)
        self.metrics.counters["remote_mm_items_held"] += sum(held)
        try:
            async for output in self._generate(handle, request, images.body(self, held),
                                               replica.url, attempt, hash_only=hash_only):
                if hash_only:  # the replica had what the mirror said
                    replica.drifts = 0
                yield output
            return
        except _DriftedCache:
            images.forget(replica)
            replica.drifts += 1
            self.metrics.counters["remote_mm_cache_resends"] += 1
            log.warning("request %s: vLLM replica %s lacked an image its cache was thought to "
                        "hold; sent again with its images in full", request.request_id,
                        replica.url)
            if replica.drifts >= DRIFTS_IN_A_ROW:
                replica.images = FeatureCache(0)
                log.warning("vLLM replica %s lacked a cached image %d times in a row: it keeps "
                            "no image cache mmlane can mirror (--mm-processor-cache-gb 0, the "
                            "shm cache, several API servers); its images go in full from now "
                            "on (--remote-mm-cache-gb 0 says so at start)", replica.url,
                            replica.drifts)
        full = images.held_by(replica, resend=True)
        async for output in self._generate(handle, request, images.body(self, full),
                                           replica.url, attempt, hash_only=False):
            yield output

    async def _generate(self, handle: int, request: EngineRequest, body: bytes, url: str,
                        attempt: _Attempt, *, hash_only: bool) -> AsyncIterator[StepOutput]:
        """The outputs of one POST of `body` to `url` (each line heard marked on `attempt`);
        _DriftedCache when the body sent images by hash (`hash_only`) and vLLM ended the
        request with an error before any token."""
        if self._max_body_bytes and len(body) > self._max_body_bytes:
            raise RequestError(
                f"the request's body for vLLM, {_mib(len(body))}, is over the replicas' body "
                f"limit of {_mib(self._max_body_bytes)} (--remote-max-body-mb): it was not "
                f"sent; send fewer or smaller images", code="request_too_large")
        first = True
        async with self._session.post(f"{url}/inference/v1/generate", data=body,
                                      headers={"Content-Type": "application/json"}) as reply:
            attempt.heard = self._loop.time()
            if reply.status >= 400:
                raise _status_error(url, reply.status, await reply.text(), len(body))
            async for line in reply.content:
                attempt.heard = self._loop.time()
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if first and hash_only and "error" in chunk:
                    raise _DriftedCache
                output = self._output(handle, chunk, request.sampling.logprobs)
                if output is not None:
                    first = False
                    yield output
                    if output.finished:
                        return
        raise RetryableError(f"vLLM replica {url} ended the stream before the request's end",
                             code="backend_unavailable")

    def _output(self, handle: int, chunk: dict[str, Any], count: int | None) -> StepOutput | None:
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            return StepOutput(handle, [], error=RetryableError(
                f"vLLM ended the request: {message}", code="aborted"))
        if not chunk.get("choices"):
            return None  # the usage chunk
        choice = chunk["choices"][0]
        tokens = list(choice.get("token_ids") or [])
        reason = choice.get("finish_reason")
        if reason is not None and reason not in FINISH_REASONS:
            return StepOutput(handle, tokens, error=RetryableError(
                f"vLLM ended the request: {reason}", code="aborted"))
        return StepOutput(handle, tokens, finish_reason=reason,
                          logprobs=_logprobs(choice.get("logprobs"), count))

    # ------------------------------------------------------------ the request for vLLM

    def _pick(self, request: EngineRequest, tried: list[Replica]) -> Replica:
        """The replica for the request: of those not yet tried (the ones up, if any), the first
        in the request's own order of them (rendezvous hashing of its affinity key: its first
        image's hash, else its prompt's first tokens) whose outstanding requests are not far
        above the mean (LOAD_SLACK)."""
        untried = [replica for replica in self._replicas if replica not in tried]
        candidates = [replica for replica in untried if replica.up] or untried
        if len(candidates) == 1:
            return candidates[0]
        first = request.mm_items[0].mm_hash if request.mm_items else ""
        key = first or str(request.prompt_token_ids[:AFFINITY_TOKENS])
        ranked = sorted(candidates, key=lambda replica: hashlib.blake2b(
            f"{key}|{replica.url}".encode(), digest_size=8).digest())
        bound = LOAD_SLACK * sum(r.outstanding for r in candidates) / len(candidates) + 1
        return next((replica for replica in ranked if replica.outstanding <= bound), ranked[0])

    def _body(self, request: EngineRequest, kwargs_data: list[str | None], *,
              embeds: bool) -> bytes:
        body = wire.generate_body(request, self.spec, kwargs_data, embeds=embeds)
        body["sampling_params"]["detokenize"] = False
        return msgspec.json.encode({**body, "stream": True, "output_mode": "tokens",
                                    "priority": 1 if self._priority and request.mm_items else 0})


class _Attempt:
    """A request's stream from one replica, as that replica's health checks see it."""

    def __init__(self) -> None:
        self.heard: float | None = None
        """When the replica last sent it anything (the loop's time); None: nothing yet."""
        self.bound: asyncio.Timeout
        """Due at once (`reschedule`) when the request gives up on the replica."""


class _DriftedCache(Exception):
    """A replica lacked an image sent as its hash."""


class _Images:
    """A request's items (images, videos) for the replicas: each encoded once, when first sent
    in full."""

    def __init__(self, request: EngineRequest,
                 tensors: list[dict[str, tuple[wire.Array, wire.Field]]], *,
                 embeds: bool) -> None:
        self.request = request
        self.embeds = embeds
        self.hashes = wire.mm_hashes(request, embeds=embeds)
        self._tensors = tensors
        self._sizes = [wire.nbytes(item) for item in tensors]
        self._encoded: dict[int, str] = {}

    def held_by(self, replica: Replica, *, resend: bool = False) -> list[bool]:
        """Which images `replica`'s engine core holds, as its cache goes through the request
        (vLLM's `get_and_update_features`): every hash it holds touched, then each image in
        order looked up, or cached as it arrives in full (evicting the least recently used).
        `resend`: none, each arriving in full again."""
        images = replica.images
        if resend:
            for mm_hash, size in zip(self.hashes, self._sizes, strict=True):
                images.put(mm_hash, size, True)
            return [False] * len(self.hashes)
        for mm_hash in self.hashes:
            images.touch(mm_hash)
        held = []
        for mm_hash, size in zip(self.hashes, self._sizes, strict=True):
            held.append(images.touch(mm_hash) is not None)
            if not held[-1]:
                images.put(mm_hash, size, True)
        return held

    def forget(self, replica: Replica) -> None:
        """The request may not have reached `replica`'s engine core: it holds none of its
        images for sure."""
        for mm_hash in self.hashes:
            replica.images.drop(mm_hash)

    def body(self, runner: RemoteVLLMRunner, held: list[bool]) -> bytes:
        return runner._body(self.request, [None if hit else self._item(index)
                                           for index, hit in enumerate(held)],
                            embeds=self.embeds)

    def _item(self, index: int) -> str:
        if index not in self._encoded:
            self._encoded[index] = wire.encode_item(self._tensors[index])
        return self._encoded[index]


def _status_error(url: str, status: int, text: str, sent: int) -> MMLaneError:
    """A replica's answer `status` with body `text` to a request whose body was `sent` bytes,
    as the request's error."""
    try:
        detail = json.loads(text)
        message = detail.get("error", {}).get("message") or detail.get("detail") or text
    except (ValueError, AttributeError):
        message = text
    if status == 413:  # a body limit in front of vLLM (vLLM 0.32 sets none)
        return RequestError(
            f"vLLM replica {url} refused the request's body, {_mib(sent)}, as over its body "
            f"limit (HTTP 413: {str(message).strip()[:200]}); send fewer or smaller images, or "
            f"raise the limit (given as --remote-max-body-mb, mmlane refuses such a request "
            f"before sending it)", code="request_too_large")
    if status < 500:
        return refusal(str(message))
    return RetryableError(f"vLLM replica {url} answered {status}: {message}",
                          code="backend_unavailable")


def _mib(size: int) -> str:
    return f"{size / 2**20:.3g} MiB ({size} bytes)"


def _logprobs(logprobs: dict[str, Any] | None, count: int | None) -> list[TokenLogprobs] | None:
    """The wire's logprobs of a chunk's tokens: vLLM's generate API gives each token's logprob
    and its `count` first entries of vLLM's map (the sampled token, then the most likely), each
    with its rank; the wire's top list is those of rank 1 to `count`, in rank order."""
    if count is None:
        return None
    result = []
    for token in (logprobs or {}).get("content") or []:
        top = sorted((entry for entry in token.get("top_logprobs", [])
                      if entry.get("rank") is not None and entry["rank"] <= count),
                     key=lambda entry: entry["rank"])
        result.append(TokenLogprobs(token["logprob"], [entry["token_id"] for entry in top],
                                    [entry["logprob"] for entry in top]))
    return result


def load(config: EngineConfig, metrics: Metrics) -> RemoteVLLMRunner:
    """The "vllm-remote" backend's factory (BACKENDS in services/engine/runner.py)."""
    if not config.vllm.vllm_url:
        raise FatalError("--backend vllm-remote needs at least one --vllm-url", code="bad_config")
    model_dir = resolve_model_dir(config.model)
    preprocessor = load_preprocessor(model_dir, "auto")
    family = preprocessor.family.name
    if family not in wire.ITEMS:
        raise FatalError(f"--backend vllm-remote cannot serve {family} models: {wire.NO_MASK}; "
                         f"it serves those of {', '.join(wire.ITEMS)} (--backend vllm serves "
                         f"every family)", code="bad_config")
    model_config = transformers.AutoConfig.from_pretrained(model_dir)
    spec = ModelSpec.of(preprocessor, model_config, max_context=preprocessor.max_context,
                        vocab_size=model_config.get_text_config().vocab_size,
                        video=videos_of(model_dir, preprocessor))
    encoder = load_lane(config, model_dir, preprocessor, wire.EMBEDS)
    runner = RemoteVLLMRunner(config.vllm.vllm_url, spec, metrics,
                              priority=config.vllm.remote_priority, encoder=encoder,
                              vision=config.vision, mm_cache_bytes=capacity_bytes(
                                  config.vllm.remote_mm_cache_gb, "remote_mm_cache_gb"),
                              max_body_bytes=int(config.vllm.remote_max_body_mb * 2**20))
    log.info("vllm-remote serves %s on %s%s", preprocessor.model_id, ", ".join(runner.urls),
             "" if encoder is None else f", images encoded here, on {encoder.model.device}")
    return runner
