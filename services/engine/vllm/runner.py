"""The "vllm" backend's runner: vLLM's AsyncLLM runs the model, fed with rendered requests.

vLLM's AsyncLLM lives on this process's `vllm-loop` thread (an asyncio loop); it starts vLLM's
engine core and workers in their own processes, so tensor, pipeline and data parallelism are
vLLM's (engine arguments pass through unchanged, see config.py). The engine's main thread calls
`add`, `step` and `abort`, which hand work to the loop thread and take outputs from a queue
(loop.py); requests are rendered for vLLM on the loop thread, which alone touches vLLM's
processor cache.

Every request reaches vLLM already rendered: token ids with the image and video placeholders
expanded, the MM worker's tensors as vLLM's per-item kwargs, mmlane's mm_hash as vLLM's hash
(so a repeated image or video also hits vLLM's encoder and prefix caches) and the placeholder
ranges, by modality ("image", "video"), via `vllm.inputs.mm_input`; vLLM runs no HF processor,
hashes nothing and expands nothing. The
tensors take the layout vLLM's own processor gives each family's model (`_VLLM_INPUTS`), and a
range whose span holds other tokens besides the image's marks its image tokens (`is_embed`), as
vLLM's processors do. Pixels stay uint8 where vLLM normalises on the device (Qwen2-VL and
Mistral 3 in vLLM 0.32); for a model where it does not, the runner normalises them as the HF
processor would (services/model/pixels.py). Either way they go in the model's layout: a
Qwen2-VL image, sent as one of its identical frames, is laid out as all of them. A video's
tensors are laid out as vLLM's processor makes them (`_VIDEO_INPUTS`): a Qwen2-VL or Qwen2.5-VL
video's `pixel_values_videos` rows (uint8, or normalised as the video processor would where
vLLM does not normalise), `video_grid_thw` and Qwen2.5-VL's `second_per_grid_ts`; a LLaVA-
OneVision video's frames, normalised here (vLLM 0.32 does not normalise that model on the
device), one batched entry a video; an InternVL video's frames, normalised here too, as rows of
the flat `pixel_values_videos` with its `video_num_patches` (its frame count) and the shared
`video_token_id`, whose tokens in the video's span take its features; their floating tensors
cast to the model's dtype as vLLM casts its processor's outputs.

vLLM keeps its own mirrored cache of items: its processor cache (P0, in this process) tracks
what its engine core's cache (P1) holds, and an item P0 holds goes to the engine core as its
hash alone. Rendered requests update P0 as vLLM's own processor does (`_vllm_items`), so a
repeated image costs no layout here and no transfer there, as in `vllm serve`. What vLLM's P0
lacks goes in full: mmlane's receiver cache (in the engine) has filled the tensors in. Should
the two drift (P0 holds an image the core lacks), vLLM ends the request with an error before
any token and drops the hashes from P0; the runner then sends it again, once, in full. Videos
are items of this cache as images are.

Text first: when vLLM runs `scheduling_policy=priority`, text-only requests go ahead of image
requests (priority 0 before 1). That only orders vLLM's queue: a text request still waits in a
step behind the image's encoder pass that step runs. With `encoder_lane`, the vision lane
(lane.py) runs the encoder here, on its own thread at image priority, and vLLM gets each
image's embeddings in place of its pixels (`image_embeds`, in the layout of vLLM's own embedding
inputs, `_EMBEDS_INPUTS`): its steps run only the language model. An image vLLM's processor
cache holds is sent as its hash, so it is not encoded again. Videos go as pixels even then:
vLLM runs their vision pass, in its steps.

vLLM's engine core dying fails every request it held (retryable, 'backend_died'), and the next
`step` raises FatalError: the engine role exits, and its supervisor starts it again. vLLM's
processes left running by a killed role are ended when the role starts again, and what they
leave in shared memory is unlinked then or at the role's stop (leftovers.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from mmlane.common import cpu_wheels
from mmlane.common.config import default_run_dir
from mmlane.common.prometheus import vllm_series
from mmlane.common.stats import Metrics
from mmlane.engine.config import EngineConfig, VisionConfig
from mmlane.engine.runner import ModelSpec, StepOutput
from mmlane.engine.vision import VisionEncoder
from mmlane.engine.vllm import leftovers
from mmlane.engine.vllm.lane import EncoderLane, load_lane
from mmlane.engine.vllm.loop import FINISH_REASONS, LoopRunner, refusal
from mmlane.engine.wire import by_modality, mm_hashes, modality
from mmlane.model import (
    PixelNorm,
    Preprocessor,
    load_preprocessor,
    model_layout,
    normalize,
    resolve_model_dir,
)
from mmlane.model.video import VideoPreprocessor, videos_of
from mmlane.protocol.errors import FatalError, MMLaneError, RetryableError, translate
from mmlane.protocol.messages import (
    VIDEO_PIXELS,
    EngineRequest,
    MMItem,
    SamplingParams,
    TokenLogprobs,
)

log = logging.getLogger(__name__)


class VLLMRunner(LoopRunner):
    """Runs requests on vLLM's AsyncLLM (see the module docstring)."""

    def __init__(self, engine_args: dict[str, Any], preprocessor: Preprocessor,
                 metrics: Metrics, pids_file: Path, encoder: VisionEncoder | None = None,
                 vision: VisionConfig | None = None,
                 video: VideoPreprocessor | None = None) -> None:
        # vLLM starts its engine core as a new interpreter: it must apply the same fixes.
        os.environ.update(cpu_wheels.child_env())
        self._pids_file = pids_file
        """Where vLLM's processes are written down (leftovers.py)."""
        leftovers.end_leftovers(pids_file)
        self.metrics = metrics
        self._pre = preprocessor
        self._dead: BaseException | None = None
        self._scheduler: dict[int, Any] = {}  # vLLM's latest SchedulerStats, by engine index
        super().__init__("vllm-loop")
        self._lane = None if encoder is None else EncoderLane(
            encoder, preprocessor.image_token_id, vision or VisionConfig(), self._loop, metrics)
        try:
            with leftovers.Watch(pids_file):  # a kill while vLLM loads leaves it behind too
                self.engine = self._call(self._start(engine_args))
        except BaseException:
            self.close()
            raise
        model_config = self.engine.model_config
        self._normalize_pixels = not _normalises_on_device(model_config)
        self._dtype = model_config.dtype
        self._priority = self.engine.vllm_config.scheduler_config.policy == "priority"
        self.spec = ModelSpec.of(
            preprocessor, model_config.hf_config, max_context=model_config.max_model_len,
            vocab_size=model_config.hf_config.get_text_config().vocab_size, video=video,
        )
        self._fields = self.engine.renderer.get_mm_processor()._get_mm_fields_config
        metrics.gauge("vllm_running", lambda: self._scheduled("num_running_reqs"))
        metrics.gauge("vllm_waiting", lambda: self._scheduled("num_waiting_reqs"))
        metrics.exposition = _vllm_exposition
        log.info("vLLM %s serves %s: max_model_len %d, scheduling %s, %s",
                 _vllm_version(), preprocessor.model_id, model_config.max_model_len,
                 self.engine.vllm_config.scheduler_config.policy,
                 f"images encoded here, on {encoder.model.device}" if encoder is not None
                 else "pixels normalised " + (
                     "here" if self._normalize_pixels else "by vLLM on the device"))

    async def _start(self, engine_args: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            args = AsyncEngineArgs(**engine_args)
        except TypeError as exc:
            raise FatalError(f"bad vLLM engine arguments: {exc}", code="bad_config") from exc
        try:
            return AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger()])
        except Exception as exc:
            raise FatalError(f"vLLM cannot start: {exc}", code="cannot_serve") from exc

    def _stat_logger(self) -> Any:
        """A vLLM stat logger that keeps each engine core's latest scheduler stats here, for
        the gauges (stats, health, top), and adds up the prompt tokens vLLM's prefix cache
        was asked for and held (`vllm_prefix_cache_queried_tokens`, `_hit_tokens`; an image's
        blocks are keyed by mmlane's hash) and the images its processor cache was asked for
        and held (`vllm_mm_cache_queried_items`, `_hit_items`: those went as their hash)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        latest = self._scheduler
        counters = self.metrics.counters
        for name in _VLLM_CACHE_COUNTERS:  # in place before the loop thread adds to them
            counters[name] = 0

        class SchedulerGauges(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    latest[engine_idx] = scheduler_stats
                    prefix = scheduler_stats.prefix_cache_stats
                    counters["vllm_prefix_cache_queried_tokens"] += prefix.queries
                    counters["vllm_prefix_cache_hit_tokens"] += prefix.hits
                if mm_cache_stats is not None:
                    counters["vllm_mm_cache_queried_items"] += mm_cache_stats.queries
                    counters["vllm_mm_cache_hit_items"] += mm_cache_stats.hits

            def log_engine_initialized(self) -> None:
                pass

        return SchedulerGauges

    def _scheduled(self, field: str) -> int:
        return sum(int(getattr(stats, field)) for stats in list(self._scheduler.values()))

    # ------------------------------------------------------------ the ModelRunner interface

    def step(self, timeout: float) -> list[StepOutput]:
        outputs = self._ready(timeout)
        if self._dead is None and not self._live and self.engine.engine_core.resources.engine_dead:
            # vLLM's monitor saw the core exit with nothing running here: no request saw it,
            # and none would before the next one failed. Exit now: the supervisor restarts us.
            self._dead = self.engine.dead_error
            self.metrics.state = "backend died"
        if self._dead is not None and not outputs:  # the failures went out first
            raise FatalError(f"vLLM's engine core died: {self._dead}", code="cannot_serve")
        return outputs

    def close(self) -> None:
        """Stop vLLM (its engine core and workers), the vision lane and the loop thread; then
        end what is left of them (a dead engine core's shared memory, say)."""
        if self._lane is not None:
            self._lane.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            self._loop.call_soon_threadsafe(engine.shutdown)
        self._stop_loop()
        leftovers.end_leftovers(self._pids_file)

    # ------------------------------------------------------------ on the loop thread

    async def _run(self, handle: int, request: EngineRequest) -> None:
        """(Cancelled, vLLM's generate() aborts the request as it unwinds.)"""
        from vllm.v1.engine.exceptions import EngineDeadError

        priority = 1 if self._priority and request.mm_items else 0
        try:
            params = _sampling_params(request.sampling)
            if await self._generate(handle, request, params, priority,
                                    retry=bool(request.mm_items)):
                # vLLM's engine core lacked an image its processor cache said it held (the
                # mirror drifted, e.g. a request cancelled on its way to the core); vLLM has
                # dropped those hashes from its processor cache, so they go in full now.
                log.warning("request %s: vLLM's engine core lacked a cached image; sent again "
                            "with its images in full", request.request_id)
                self.metrics.counters["vllm_mm_cache_resends"] += 1
                await self._generate(handle, request, params, priority, retry=False)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._dead = exc
            self.metrics.state = "backend died"  # health and top say so until the role exits
            self._outputs.put(StepOutput(handle, [], error=RetryableError(
                "vLLM's engine core died; the engine restarts", code="backend_died")))
        except Exception as exc:
            self._outputs.put(StepOutput(handle, [], error=_request_error(exc)))

    async def _generate(self, handle: int, request: EngineRequest, params: Any, priority: int,
                        *, retry: bool) -> bool:
        """Run the request on vLLM and put its outputs; True, with nothing put, when `retry`
        and vLLM ended it with an error before any token (its answer to a drifted cache)."""
        first = True
        try:
            prompt = await self._prompt(request)  # vLLM's processor cache updated: _vllm_items
            async for output in self.engine.generate(prompt, params, request.request_id,
                                                     priority=priority):
                completion = output.outputs[0]
                reason = completion.finish_reason if output.finished else None
                if output.finished and reason not in FINISH_REASONS:
                    if retry and first and reason == "error" and not completion.token_ids:
                        return True
                    self._outputs.put(StepOutput(handle, list(completion.token_ids), error=(
                        RetryableError(f"vLLM ended the request: {reason}", code="aborted"))))
                    return False
                first = False
                self._outputs.put(StepOutput(
                    handle, list(completion.token_ids), finish_reason=reason,
                    logprobs=_logprobs(completion, params.logprobs)))
        except BaseException:
            # Failed, refused or cancelled before its first output, it may never have reached
            # vLLM's engine core: its processor cache forgets the request's images (a forgotten
            # image is only sent again; one held there but not in the core fails a request).
            cache = self.engine.renderer.mm_processor_cache
            if first and cache is not None:
                for mm_hash in mm_hashes(request, embeds=self._lane is not None):
                    cache.invalidate(mm_hash)
            raise
        return False

    # ------------------------------------------------------------ rendering for vLLM

    async def _prompt(self, request: EngineRequest) -> Any:
        if not request.mm_items:
            return {"type": "token", "prompt_token_ids": list(request.prompt_token_ids)}
        from vllm.inputs import mm_input
        from vllm.multimodal.inputs import PlaceholderRange

        hashes = mm_hashes(request, embeds=self._lane is not None)
        kwargs = await self._vllm_items(request, hashes)
        prompt = torch.tensor(request.prompt_token_ids)
        placeholders = [PlaceholderRange(item.offset, item.length, _is_embed(
            prompt[item.offset:item.offset + item.length], self._feature_token(item)))
            for item in request.mm_items]
        return mm_input(list(request.prompt_token_ids), kwargs, by_modality(request, hashes),
                        by_modality(request, placeholders))

    def _feature_token(self, item: MMItem) -> int:
        """The token that takes the item's features: its video's or its image's."""
        if item.is_video and self.spec.video is not None:
            return self.spec.video.video_token_id
        return self._pre.image_token_id

    async def _vllm_items(self, request: EngineRequest, hashes: list[str]) -> Any:
        """The items as vLLM's kwargs, by modality, each in full or, where vLLM's processor
        cache (P0, which mirrors its engine core's) holds its hash, as None: the engine core
        takes that one from its cache. P0 is updated as vLLM's processor updates it
        (`_merge_mm_kwargs`): every hash touched first, then each looked up or added, in
        prompt order (the engine core's), with no wait between (another request's update would
        come between); only the items it lacks are laid out, or with the vision lane its images
        encoded, first. No P0 (`mm_processor_cache_gb=0`): every item in full."""
        from vllm.multimodal.inputs import MultiModalKwargsItems

        items = request.mm_items
        cache = self.engine.renderer.mm_processor_cache
        encoded: dict[int, torch.Tensor] = {}
        while True:
            held = cache.is_cached(hashes) if cache is not None else [False] * len(hashes)
            todo = [index for index, hit in enumerate(held)
                    if not hit and index not in encoded and not items[index].is_video]
            if self._lane is None or not todo:
                break
            # Dropped from P0 during the wait, an image is encoded in the next round.
            encoded.update(zip(todo, await self._lane.embeddings(request, todo), strict=True))
        missing = [index for index, hit in enumerate(held) if not hit]
        built = dict(zip(missing, self._built([items[index] for index in missing],
                                              [encoded.get(index) for index in missing]),
                         strict=True))
        if cache is None:
            return MultiModalKwargsItems(by_modality(request, list(built.values())))
        for mm_hash in hashes:
            cache.touch_sender_cache_item(mm_hash)
        try:
            sent = [cache.get_and_update_item(None if hit else (built[index], []), mm_hash)[0]
                    for index, (mm_hash, hit) in enumerate(zip(hashes, held, strict=True))]
        finally:
            cache.release_sender_touches()
        self.engine.renderer.update_mm_cache_stats()
        return MultiModalKwargsItems(by_modality(request, sent))

    def _built(self, items: list[MMItem], embeds: list[torch.Tensor | None]) -> list[Any]:
        """vLLM's kwargs items of `items` (with their embeddings where the vision lane made
        some), in order: laid out in one batch as vLLM's processor lays out a prompt's images
        and videos, then split by vLLM's fields."""
        from transformers import BatchFeature
        from vllm.multimodal.inputs import MultiModalKwargsItems

        images = [self._item_tensors(item.tensors) if rows is None
                  else _embeds_item(item.tensors, rows)
                  for item, rows in zip(items, embeds, strict=True) if not item.is_video]
        video = self.spec.video  # None: the engine refuses video items
        norm = video.pixel_norm if self._normalize_pixels and video else None
        videos = [_video_tensors(item.tensors, self._dtype, norm)
                  for item in items if item.is_video]
        batch = BatchFeature({})
        if images:
            layout = _VLLM_INPUTS if self._lane is None else _EMBEDS_INPUTS
            batch.update(layout[self._pre.family.name](images, self._pre.image_token_id))
        if videos and video is not None:
            batch.update(_VIDEO_INPUTS[self._pre.family.name](videos, video.video_token_id))
        if not batch:
            return []
        built = MultiModalKwargsItems.from_hf_inputs(batch, self._fields(batch, {}))
        kinds = {kind: iter(built[kind]) for kind in built}
        return [next(kinds[modality(item)]) for item in items]

    def _item_tensors(self, tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """An image's tensors as torch's, its pixels in the model's layout (`model_layout`)
        and normalised unless vLLM does it."""
        arrays = _writeable(tensors)
        item = {name: torch.from_numpy(array) for name, array in arrays.items()}
        norm = self._pre.pixel_norm
        item["pixel_values"] = (  # laid out by numpy: torch's copy would wake an OpenMP team
            normalize(item["pixel_values"], norm) if self._normalize_pixels  # that spins here
            else torch.from_numpy(model_layout(arrays["pixel_values"], norm)))
        return item


def _video_tensors(tensors: dict[str, np.ndarray], dtype: torch.dtype,
                   norm: PixelNorm | None) -> dict[str, torch.Tensor]:
    """A video's tensors as torch's, its pixels normalised by `norm` (the video processor's,
    where vLLM does not normalise them), its floating tensors in the model's `dtype`, as vLLM
    casts its processor's outputs."""
    item = {name: torch.from_numpy(array) for name, array in _writeable(tensors).items()}
    if norm is not None:
        item[VIDEO_PIXELS] = normalize(item[VIDEO_PIXELS], norm)
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
            for name, tensor in item.items()}


def _writeable(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An item's arrays, each one torch may take: arrays that came in ZMQ frames are read-only
    views of them, and are copied; those taken out of a shared-memory slot are copies already,
    and go as they are."""
    return {name: array if array.flags.writeable else array.copy()
            for name, array in tensors.items()}


def _embeds_item(tensors: dict[str, np.ndarray], embeds: torch.Tensor) -> dict[str, torch.Tensor]:
    """An item for vLLM's embedding inputs: its embeddings, and its tensors but the pixels
    (copies: arrays that came in ZMQ frames are read-only views of them)."""
    others = {name: torch.from_numpy(np.array(array))
              for name, array in tensors.items() if name != "pixel_values"}
    return {"image_embeds": embeds, **others}


_VLLM_CACHE_COUNTERS = ("vllm_prefix_cache_queried_tokens", "vllm_prefix_cache_hit_tokens",
                        "vllm_mm_cache_queried_items", "vllm_mm_cache_hit_items")


def _vllm_exposition() -> str:
    """vLLM's own metrics in this process (its Prometheus logger's `vllm:` series, those a
    `vllm serve` shows at /metrics), in Prometheus' text format, for the stats (`mmlane
    exporter` shows them)."""
    from prometheus_client import REGISTRY, generate_latest

    return vllm_series(generate_latest(REGISTRY).decode())


def _is_embed(span: torch.Tensor, image_token_id: int) -> torch.Tensor | None:
    """Which of a span's positions take the image's features, as vLLM's processors mark them
    (`PromptUpdateDetails.select_token_id`): its image tokens, not the tokens around them
    (Mistral 3's row breaks, InternVL's <img>, Idefics3's row/column tokens). None: all of
    them, as vLLM leaves a span of image tokens alone."""
    mask = span == image_token_id
    return None if bool(mask.all()) else mask


# The batch of a request's items in the layout vLLM's own processor gives its model (the
# HF processor's output after vLLM's `_call_hf_processor`), from each family's items
# (services/model/families.py), by family name; `_get_mm_fields_config` splits it into items.
Items = list[dict[str, torch.Tensor]]


def _concatenated(*names: str) -> Callable[[Items, int], dict[str, Any]]:
    """The items' tensors concatenated on their first axis (one image's rows, or tiles); one
    item's as they are (torch.cat would copy them)."""
    return lambda items, image_token_id: {
        name: torch.cat([item[name] for item in items]) if len(items) > 1 else items[0][name]
        for name in names}


def _llava_next_inputs(items: Items, image_token_id: int) -> dict[str, Any]:
    # The HF processor's batch: each image's tiles, padded with zero tiles to the most of any.
    return {"pixel_values": pad_sequence([item["pixel_values"] for item in items],
                                         batch_first=True),
            "image_sizes": torch.cat([item["image_sizes"] for item in items])}


def _mistral3_inputs(items: Items, image_token_id: int) -> dict[str, Any]:
    # vLLM cuts the HF processor's padding off again: each image its own size, in a list.
    return {"pixel_values": [item["pixel_values"][0] for item in items]}


def _internvl_inputs(items: Items, image_token_id: int) -> dict[str, Any]:
    return {**_concatenated("pixel_values")(items, image_token_id),
            "image_num_patches": torch.tensor([len(item["pixel_values"]) for item in items]),
            "image_token_id": torch.tensor(image_token_id)}


def _idefics3_inputs(items: Items, image_token_id: int) -> dict[str, Any]:
    # Every tile is whole (services/model/families.py): its pixel_attention_mask is all ones.
    pixels = torch.cat([item["pixel_values"] for item in items])
    return {"pixel_values": pixels,
            "pixel_attention_mask": torch.ones((len(pixels), *pixels.shape[2:]), dtype=torch.bool),
            "num_patches": torch.tensor([len(item["pixel_values"]) for item in items])}


_VLLM_INPUTS: dict[str, Callable[[Items, int], dict[str, Any]]] = {
    "qwen2_vl": _concatenated("pixel_values", "image_grid_thw"),
    "llava": _concatenated("pixel_values"),
    "llava_next": _llava_next_inputs,
    "llava_onevision": _llava_next_inputs,
    "mistral3": _mistral3_inputs,
    "internvl": _internvl_inputs,
    "idefics3": _idefics3_inputs,
}


_EMBEDS_INPUTS: dict[str, Callable[[Items, int], dict[str, Any]]] = {
    "qwen2_vl": _concatenated("image_embeds", "image_grid_thw"),
    "llava": lambda items, image_token_id: {  # one (tokens, hidden) entry per image
        "image_embeds": torch.stack([item["image_embeds"] for item in items])},
}
"""With the vision lane: the batch of a request's items as vLLM's embedding inputs (its
models' `image_embeds` fields), from each item's embeddings and its other tensors."""


def _qwen2_vl_videos(items: Items, video_token_id: int) -> dict[str, Any]:
    """A prompt's Qwen2-VL or Qwen2.5-VL videos as its HF processor batches them: each tensor
    of the videos concatenated on its first axis (their pixel rows, their grids' rows, their
    seconds per grid step)."""
    return _concatenated(*items[0])(items, video_token_id)


def _llava_onevision_videos(items: Items, video_token_id: int) -> dict[str, Any]:
    """A prompt's LLaVA-OneVision videos as vLLM's processor keeps them: it calls the HF
    processor once per video and lists each one's frames (their counts may differ)."""
    return {VIDEO_PIXELS: [item[VIDEO_PIXELS] for item in items]}


def _internvl_videos(items: Items, video_token_id: int) -> dict[str, Any]:
    """A prompt's InternVL videos as vLLM's InternS1 processor batches them (it calls the HF
    processor once per video): their frames concatenated, each video's frame count, and the
    video token, as an image's tiles, counts and token (`_internvl_inputs`)."""
    return {**_concatenated(VIDEO_PIXELS)(items, video_token_id),
            "video_num_patches": torch.tensor([len(item[VIDEO_PIXELS]) for item in items]),
            "video_token_id": torch.tensor(video_token_id)}


_VIDEO_INPUTS: dict[str, Callable[[Items, int], dict[str, Any]]] = {
    "qwen2_vl": _qwen2_vl_videos,
    "llava_onevision": _llava_onevision_videos,
    "internvl": _internvl_videos,
}
"""The batch of a request's videos in the layout vLLM's own processor gives its model, from
their tensors and the video token, by family; the videos of a family not here are refused
(the runner's spec has no video)."""


def _sampling_params(sampling: SamplingParams) -> Any:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    # One to one: mmlane's sampling fields are named and mean as vLLM's.
    fields = msgspec.structs.asdict(sampling)
    if sampling.structured_outputs is not None:
        # Whitespace is the engine's setting in vLLM 0.32 (its backends ignore the request's
        # disable_any_whitespace): structured_outputs_config, see README "Serving with vLLM".
        fields["structured_outputs"] = StructuredOutputsParams(
            **sampling.structured_outputs.vllm_fields())
    return VLLMSamplingParams(
        **fields,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,  # the frontend detokenizes
    )


def _logprobs(completion: Any, count: int | None) -> list[TokenLogprobs] | None:
    """The wire's logprobs of a vLLM CompletionOutput's new tokens (None unless asked for).

    vLLM gives, per token, a dict token id -> Logprob holding the sampled token first, then the
    `count` most likely in order, the sampled one not repeated: when it is among them (the dict
    has `count` entries), its rank (1-based) says where it goes back in."""
    if count is None:
        return None
    logprobs = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        entries = list(position.items())  # (token id, Logprob), the sampled token first
        sampled = entries[0][1]
        top = [(other_id, other.logprob) for other_id, other in entries[1:]]
        if len(entries) == count:
            top.insert(sampled.rank - 1, (token_id, sampled.logprob))
        logprobs.append(TokenLogprobs(sampled.logprob, [other_id for other_id, _ in top],
                                      [logprob for _, logprob in top]))
    return logprobs


def _request_error(exc: Exception) -> MMLaneError:
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, VLLMClientError):
        return refusal(str(exc))
    return translate(exc, f"vLLM failed on this request: {type(exc).__name__}: {exc}",
                     default="model_error")


def _normalises_on_device(model_config: Any) -> bool:
    multimodal = getattr(model_config, "multimodal_config", None)
    return bool(getattr(multimodal, "mm_device_do_normalize", False))


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


CPU_KV_CACHE_SHARE = 0.25
"""The share of the memory available at start that a CPU host's KV cache gets by default."""
CPU_KV_CACHE_MAX_BYTES = 4 * 2**30
"""The most a CPU host's KV cache gets by default."""


def _size_cpu_kv_cache(engine_args: dict[str, Any]) -> None:
    """On a CPU host, vLLM reserves `gpu_memory_utilization` (0.92 by default) of the machine's
    memory and refuses to start unless that much is free. Unless the arguments (or vLLM's
    VLLM_CPU_KVCACHE_SPACE) size the KV cache themselves, give it a quarter of the memory
    available now, at most CPU_KV_CACHE_MAX_BYTES, as `kv_cache_memory_bytes`, and say so."""
    from vllm.platforms import current_platform

    chosen = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & engine_args.keys()
    if not current_platform.is_cpu() or chosen or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return
    import psutil  # a dependency of vLLM's

    available = psutil.virtual_memory().available
    size = min(int(available * CPU_KV_CACHE_SHARE), CPU_KV_CACHE_MAX_BYTES)
    engine_args["kv_cache_memory_bytes"] = size
    log.info("vLLM on the CPU: a KV cache of %.2f GiB (kv_cache_memory_bytes; %d%% of the "
             "%.1f GiB available, at most %d GiB); choose with --vllm-arg "
             "kv_cache_memory_bytes=N or gpu_memory_utilization=F", size / 2**30,
             CPU_KV_CACHE_SHARE * 100, available / 2**30, CPU_KV_CACHE_MAX_BYTES // 2**30)


def load(config: EngineConfig, metrics: Metrics) -> VLLMRunner:
    """The "vllm" backend's factory (BACKENDS in services/engine/runner.py)."""
    model_dir = resolve_model_dir(config.model)
    # The tokenizer and placeholder description are mmlane's; vLLM only checks and runs. The
    # image processor's backend is the one vLLM's own processor gets (transformers' choice):
    # pixels are normalised as there.
    preprocessor = load_preprocessor(model_dir, "auto")
    engine_args = {"model": str(model_dir), **config.vllm.engine_args()}
    _size_cpu_kv_cache(engine_args)
    if config.vllm.encoder_lane and engine_args.setdefault("enable_mm_embeds", True) is not True:
        raise FatalError("--encoder-lane hands vLLM image embeddings: it needs vLLM's "
                         "enable_mm_embeds, which --vllm-arg turns off", code="bad_config")
    encoder = load_lane(config, model_dir, preprocessor, _EMBEDS_INPUTS)
    pids = leftovers.pids_file(default_run_dir(), config.ops.name)
    video = videos_of(model_dir, preprocessor) if preprocessor.family.name in _VIDEO_INPUTS \
        else None
    return VLLMRunner(engine_args, preprocessor, metrics, pids, encoder, config.vision, video)
