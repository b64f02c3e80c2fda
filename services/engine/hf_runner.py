"""The embedded default runner: a Hugging Face model run with torch, one unit at a time.

Requests are not batched: each round advances every request in progress by one unit (see
scheduler.py), each unit a forward pass of batch size one over that request's own KV cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import DynamicCache

from protocol.errors import FatalError, MMLaneError, RequestError, RetryableError
from protocol.messages import EngineRequest
from services.engine.adapters import Adapter, adapter_for
from services.engine.runner import ModelSpec, StepOutput
from services.engine.scheduler import plan_round
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


class HFRunner:
    """Runs requests on a transformers model: vision, prefill and decode units, batch size one."""

    def __init__(
        self, model: Any, spec: ModelSpec, adapter: Adapter, *,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        self.model = model  # a transformers model (Any: its submodules are untyped)
        self.spec = spec
        self.adapter = adapter
        self.prefill_chunk_tokens = prefill_chunk_tokens
        """None prefills a prompt in one unit; a number splits it (the KV cache carries over)."""
        self._sequences: dict[int, Sequence] = {}

    @classmethod
    def load(cls, model: str | None, device: str) -> HFRunner:
        """Load the model directory (None: the embedded tiny model) onto `device`."""
        model_dir = resolve_model_dir(model)
        preprocessor = load_preprocessor(model_dir)
        network: Any = load_model(model_dir, pick_device(device))
        adapter = adapter_for(preprocessor.family.name, network)
        spec = ModelSpec(
            family=preprocessor.family.name,
            image_token_id=preprocessor.image_token_id,
            eos_token_ids=frozenset(preprocessor.eos_token_ids),
            max_context=preprocessor.max_context,
            vocab_size=network.get_input_embeddings().num_embeddings,
            image_fields=preprocessor.family.item_fields,
            count_image_tokens=preprocessor.count_image_tokens,
            check_items=adapter.check_items,
        )
        log.info("loaded %s (%s) on %s", model_dir, spec.family, network.device)
        return cls(network, spec, adapter)

    # ------------------------------------------------------------ the ModelRunner interface

    def add(self, handle: int, request: EngineRequest) -> None:
        prompt = torch.tensor([request.prompt_token_ids], device=self.model.device)
        cache = DynamicCache(config=self.model.config.get_text_config())
        self._sequences[handle] = Sequence(handle, request, prompt, cache, self.spec.eos_token_ids)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs = []
        for seq in plan_round(list(self._sequences.values()), self.prefill_chunk_tokens):
            output = self._advance(seq)
            if output is not None:
                outputs.append(output)
        return outputs

    def abort(self, handle: int) -> None:
        self._sequences.pop(handle, None)

    def has_work(self) -> bool:
        return bool(self._sequences)

    # ------------------------------------------------------------ units

    def _advance(self, seq: Sequence) -> StepOutput | None:
        """Run `seq`'s next unit; an output when it produced a token or failed."""
        try:
            token = self._run(seq, seq.next_unit(self.prefill_chunk_tokens))
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
        item = seq.request.mm_items[index]
        features = self.adapter.image_features(item.tensors)
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
