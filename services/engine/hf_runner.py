"""The embedded default runner: a Hugging Face model run with torch, one unit at a time.

Each `step` runs one unit of one request, picked by the scheduler (scheduler.py): a slice of an
image's vision pass, a prefill chunk, or a decode step, each a forward pass of batch size one
over that request's own KV cache. Requests are not batched: on CPU, a batched forward does not
give bit-identical logits to the same request run alone (BENCHMARKS.md), and a request's tokens
must not depend on what else the engine is running.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from transformers import DynamicCache

from protocol.errors import FatalError, MMLaneError, RequestError, RetryableError
from protocol.messages import EngineRequest
from services.common.stats import Metrics
from services.engine.adapters import Adapter, adapter_for
from services.engine.runner import ModelSpec, StepOutput
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence, Unit, UnitKind
from services.model import load_model, load_preprocessor, resolve_model_dir

log = logging.getLogger(__name__)


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


class HFRunner:
    """Runs requests on a transformers model: vision, prefill and decode units, batch size one."""

    def __init__(
        self, model: Any, spec: ModelSpec, adapter: Adapter, *,
        prefill_chunk_tokens: int | None = None, metrics: Metrics | None = None,
    ) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)
        self.spec = spec
        self.adapter = adapter
        self.prefill_chunk_tokens = prefill_chunk_tokens
        """The most tokens a unit takes: prefill chunks (the KV cache carries over) and vision
        slices (in image tokens). None runs a whole prompt, or a whole image, as one unit."""
        self.metrics = metrics or Metrics("engine", "engine")
        """Where unit times (engine_step:KIND) and first-unit waits (queue_wait:KIND) go."""
        self._sequences: dict[int, Sequence] = {}
        self._scheduler = Scheduler()
        self._units = 0  # units run so far: the scheduler's round-robin clock

    @classmethod
    def load(
        cls, model: str | None, device: str, *, prefill_chunk_tokens: int | None = None,
        threads: int = 0, metrics: Metrics | None = None,
    ) -> HFRunner:
        """Load the model directory (None: the embedded tiny model) onto `device`; torch gets
        `threads` threads per CPU operation (see `torch_threads`)."""
        torch.set_num_threads(torch_threads(threads))
        model_dir = resolve_model_dir(model)
        preprocessor = load_preprocessor(model_dir)
        network: Any = load_model(model_dir, pick_device(device))
        adapter = adapter_for(preprocessor.family.name, network)
        spec = ModelSpec(
            family=preprocessor.family.name,
            model_id=preprocessor.model_id,
            image_token_id=preprocessor.image_token_id,
            eos_token_ids=frozenset(preprocessor.eos_token_ids),
            max_context=preprocessor.max_context,
            vocab_size=network.get_input_embeddings().num_embeddings,
            image_fields=preprocessor.family.item_fields,
            count_image_tokens=preprocessor.count_image_tokens,
            check_items=adapter.check_items,
        )
        log.info("loaded %s (%s) on %s, %d torch threads", model_dir, spec.family,
                 network.device, torch.get_num_threads())
        return cls(network, spec, adapter, prefill_chunk_tokens=prefill_chunk_tokens,
                   metrics=metrics)

    # ------------------------------------------------------------ the ModelRunner interface

    def add(self, handle: int, request: EngineRequest, *, arrived: float | None = None) -> None:
        prompt = torch.tensor([request.prompt_token_ids], device=self.model.device)
        cache = DynamicCache(config=self.model.config.get_text_config())
        self._sequences[handle] = Sequence(
            handle, request, prompt, cache, self.spec.eos_token_ids,
            arrived=time.monotonic() if arrived is None else arrived,
        )

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        picked = self._scheduler.pick(self._sequences.values())
        if picked is None:
            return []
        seq, lane = picked
        unit = seq.next_unit(self.prefill_chunk_tokens)
        started = time.monotonic()
        if seq.last_run < 0:
            self.metrics.observe(f"queue_wait:{seq.kind}", started - seq.arrived)
        seq.last_run = self._units
        self._units += 1
        output = self._advance(seq, unit)
        if self.model.device.type == "cuda":  # kernels run asynchronously: time what they took
            torch.cuda.synchronize(self.model.device)
        elapsed = time.monotonic() - started
        self._scheduler.charge(lane, elapsed)
        self.metrics.observe(f"engine_step:{unit.kind.label}", elapsed)
        return [] if output is None else [output]

    def abort(self, handle: int) -> None:
        self._sequences.pop(handle, None)

    def has_work(self) -> bool:
        return bool(self._sequences)

    # ------------------------------------------------------------ units

    def _advance(self, seq: Sequence, unit: Unit) -> StepOutput | None:
        """Run `seq`'s next unit; an output when it produced a token or failed."""
        try:
            token = self._run(seq, unit)
        except Exception as exc:  # one request's failure must not stop the others
            log.exception("request %s failed in the model", seq.request.request_id)
            self.abort(seq.handle)
            return StepOutput(seq.handle, [], error=_model_error(exc))
        if token is None:
            return None
        seq.output_ids.append(token)
        reason = seq.finish_reason()
        if reason is not None:
            self.abort(seq.handle)
        return StepOutput(seq.handle, [token], finish_reason=reason)

    def _run(self, seq: Sequence, unit: Unit) -> int | None:
        if unit.kind is UnitKind.VISION:
            self._encode_image(seq, unit.image)
            return None
        if unit.kind is UnitKind.PREFILL:
            logits = self._prefill(seq, unit.tokens)
            return seq.sampler(logits) if seq.num_cached == seq.prompt_len else None
        return seq.sampler(self._decode(seq))

    def _encode_image(self, seq: Sequence, index: int) -> None:
        """Run the next slice of image `index`'s vision pass (starting it if need be)."""
        item = seq.request.mm_items[index]
        if seq.vision is None:
            seq.vision = self.adapter.vision_pass(item.tensors, self.prefill_chunk_tokens)
        features = seq.vision.step()
        if features is None:
            return
        seq.vision = None
        if features.shape[0] != item.length:
            raise RequestError(
                f"mm_items[{index}] made {features.shape[0]} image embeddings "
                f"for its {item.length} tokens"
            )
        seq.image_features[index] = features

    def _prefill(self, seq: Sequence, count: int) -> torch.Tensor:
        """Put prompt tokens [num_cached, num_cached + count) into the cache; the last logits."""
        start, end = seq.num_cached, seq.num_cached + count
        if seq.positions is None:
            seq.positions = self.adapter.positions(seq.prompt, seq.request.mm_items)
        embeds = self._prompt_embeddings(seq, start, end)
        out = self.model(
            inputs_embeds=embeds, position_ids=seq.positions.prompt(start, end),
            cache=seq.cache, use_cache=True, logits_to_keep=1,
        )
        seq.num_cached = end
        if end == seq.prompt_len:
            seq.image_features = []  # in the KV cache now
        return out.logits[0, -1]

    def _prompt_embeddings(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Token embeddings of prompt[start:end], image placeholders replaced by image features."""
        embeds = self.model.get_input_embeddings()(seq.prompt[:, start:end])
        for item, features in zip(seq.request.mm_items, seq.image_features, strict=True):
            first, last = max(start, item.offset), min(end, item.offset + item.length)
            if first < last and features is not None:
                rows = features[first - item.offset : last - item.offset]
                embeds[0, first - start : last - start] = rows.to(embeds.dtype)
        return embeds

    def _decode(self, seq: Sequence) -> torch.Tensor:
        assert seq.positions is not None  # set by the prefill, which always comes first
        position = seq.cache.get_seq_length()
        last = torch.tensor([[seq.output_ids[-1]]], dtype=torch.long, device=self.model.device)
        out = self.model(
            input_ids=last, position_ids=seq.positions.decode(position),
            cache=seq.cache, use_cache=True,
        )
        return out.logits[0, -1]


def _model_error(exc: Exception) -> MMLaneError:
    if isinstance(exc, MMLaneError):
        return exc
    if isinstance(exc, torch.OutOfMemoryError):
        return RetryableError(f"the engine ran out of device memory: {exc}", code="overloaded")
    return RequestError(
        f"the model failed on this request: {type(exc).__name__}: {exc}", code="model_error"
    )
