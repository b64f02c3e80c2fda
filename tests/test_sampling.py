"""The HF backend's sampler on the tiny model's real logits: the logit bias and the penalties
as vLLM defines them, for greedy and sampled requests; structured output's grammars on the tiny
model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmlane.engine.hf.sampling import Sampler
from mmlane.model import Preprocessor, load_model
from mmlane.model.grammar import Grammars, check_grammar, hf_tokenizer
from mmlane.protocol.errors import RequestError
from mmlane.protocol.sampling import SamplingParams, StructuredOutputs, check_sampling

PROMPT = "Count the lanes."


@pytest.fixture(scope="module")
def prompt_ids(prep: Preprocessor) -> list[int]:
    return prep.tokenize_batch([prep.render_prompt([{"role": "user", "content": PROMPT}])])[0]


@pytest.fixture(scope="module")
def logits(qwen_dir: Path, prompt_ids: list[int]) -> torch.Tensor:
    """The tiny model's next-token logits after the prompt, (vocab,) float32."""
    model = load_model(qwen_dir, "cpu")
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].float()


def sampler(prompt_ids: list[int], **fields: object) -> Sampler:
    return Sampler(SamplingParams(**fields), prompt_ids)  # type: ignore[arg-type]


def penalised(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], *,
              repetition: float = 1.0, frequency: float = 0.0,
              presence: float = 0.0) -> list[float]:
    """vLLM's penalties, token by token, as its docs define them."""
    out = []
    for token, value in enumerate(logits.tolist()):
        if token in prompt_ids or token in output_ids:
            value = value / repetition if value > 0 else value * repetition
        count = output_ids.count(token)
        out.append(value - frequency * count - presence * (count > 0))
    return out


def test_no_bias_or_penalty_leaves_the_logits_alone(logits, prompt_ids) -> None:
    greedy = sampler(prompt_ids)
    assert greedy.adjusted(logits, [1, 2]) is logits
    assert greedy(logits, [1, 2]) == int(logits.argmax())


@pytest.mark.parametrize("penalties", [
    {"repetition": 1.3}, {"repetition": 0.7}, {"frequency": 0.5}, {"presence": -0.8},
    {"repetition": 1.5, "frequency": 1.0, "presence": 2.0},
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalties_change_the_logits_as_defined(logits, prompt_ids, penalties) -> None:
    top = logits.topk(3).indices.tolist()
    output_ids = [top[0], top[0], top[1], 7]  # repeats, and a token of neither top nor prompt
    fields = {"repetition_penalty": penalties.get("repetition", 1.0),
              "frequency_penalty": penalties.get("frequency", 0.0),
              "presence_penalty": penalties.get("presence", 0.0)}
    adjusted = sampler(prompt_ids, **fields).adjusted(logits, output_ids)
    expected = penalised(logits, prompt_ids, output_ids, **penalties)
    assert adjusted.dtype == torch.float32
    assert torch.allclose(adjusted, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert not torch.equal(adjusted, logits)


def test_the_bias_comes_before_the_repetition_penalty(logits, prompt_ids) -> None:
    token = int(logits.argmin())  # negative: the bias makes it positive, then it is divided
    bias = 50.0 - float(logits[token])
    adjusted = sampler(prompt_ids, logit_bias={token: bias}, repetition_penalty=2.0)
    assert float(adjusted.adjusted(logits, [token])[token]) == pytest.approx(25.0, rel=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_large_negative_bias_bans_a_token(logits, prompt_ids, temperature) -> None:
    favourite = int(logits.argmax())
    picks = sampler(prompt_ids, temperature=temperature, seed=3, logit_bias={favourite: -100})
    tokens = {picks(logits, []) for _ in range(200)}
    assert favourite not in tokens
    if temperature == 0:
        assert tokens == {int(logits.topk(2).indices[1])}


def test_a_large_positive_bias_forces_a_token_in_greedy(logits, prompt_ids) -> None:
    unlikely = int(logits.argmin())
    assert sampler(prompt_ids, logit_bias={unlikely: 100})(logits, []) == unlikely


def test_a_frequency_penalty_moves_greedy_off_a_repeated_token(logits, prompt_ids) -> None:
    favourite = int(logits.argmax())
    assert sampler(prompt_ids, frequency_penalty=2.0)(logits, [favourite] * 50) != favourite


@pytest.mark.parametrize(("fields", "message"), [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": float("nan")}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be above 0 and finite, got 0.0"),
    ({"logit_bias": {5: 101.0}}, r"logit_bias: the bias of 5 must be in \[-100, 100\]"),
    ({"logit_bias": {-1: 1.0}}, r"logit_bias: -1 is outside the vocabulary \(0..999\)"),
    ({"logit_bias": {10**9: 1.0}}, r"logit_bias: 1000000000 is outside the vocabulary"),
])
def test_check_sampling_names_a_bad_bias_or_penalty(fields, message) -> None:
    with pytest.raises(RequestError, match=message):
        check_sampling(SamplingParams(**fields), vocab_size=1000)  # type: ignore[arg-type]


ENUM = StructuredOutputs(json='{"enum": ["red", "blue"]}')


@pytest.fixture(scope="module")
def grammars(prep: Preprocessor, logits: torch.Tensor) -> Grammars:
    tokenizer = hf_tokenizer(prep.tokenizer, vocab_size=logits.shape[0],
                             eos_token_ids=prep.eos_token_ids)
    return Grammars(tokenizer, capacity=2)


def test_each_request_gets_its_own_place_in_a_shared_grammar(grammars, prep, logits) -> None:
    first, second = grammars.matcher(ENUM), grammars.matcher(ENUM)
    quote = prep.tokenizer.convert_tokens_to_ids('"')
    for token in prep.tokenizer.encode('"red"', add_special_tokens=False):
        assert first.mask(logits)[token] > float("-inf")
        first.accept(token)
    assert first.done and not second.done
    allowed = torch.isfinite(second.mask(logits)).nonzero().flatten().tolist()
    assert quote in allowed and len(allowed) < logits.shape[0] // 10


def test_a_forbidden_token_fails_the_request(grammars, prep) -> None:
    matcher = grammars.matcher(ENUM)
    with pytest.raises(RuntimeError, match="the grammar refused token"):
        matcher.accept(prep.tokenizer.convert_tokens_to_ids("}"))


@pytest.mark.parametrize(("structured", "text"), [
    (StructuredOutputs(regex="(lane|road)-[0-9]"), "road-7"),
    (StructuredOutputs(choice=("north", "south")), "south"),
    (StructuredOutputs(grammar='start: "go " DIR\nDIR: "left" | "right"'), "go left"),
    (StructuredOutputs(grammar='root ::= "a" ("b" | "c") "d"'), "acd"),
], ids=["regex", "choice", "lark", "gbnf"])
def test_each_kind_of_constraint_takes_its_text_and_ends(grammars, prep, logits, structured,
                                                         text) -> None:
    matcher = grammars.matcher(structured)
    for token in prep.tokenizer.encode(text, add_special_tokens=False):
        assert matcher.mask(logits)[token] > float("-inf")
        matcher.accept(token)
    assert matcher.done


@pytest.mark.parametrize(("structured", "message"), [
    (StructuredOutputs(json='{"type": "strin"}'), "Invalid type: strin"),
    (StructuredOutputs(json="{not json"), "the JSON schema is not a JSON object"),
    (StructuredOutputs(regex="(a"), "the regex cannot be used"),
    (StructuredOutputs(grammar="start: ???"), "the grammar cannot be used"),
    (StructuredOutputs(choice=()), "choice must hold at least one text"),
    (StructuredOutputs(regex="a", grammar="start: a"), "set exactly one of .* got regex, grammar"),
    (StructuredOutputs(), "set exactly one of .* got none"),
], ids=["bad-type", "not-json", "bad-regex", "bad-grammar", "no-choice", "two", "none"])
def test_a_schema_that_cannot_compile_names_the_field(grammars, structured, message) -> None:
    for check in (check_grammar, grammars.matcher):  # the frontend's check, the engine's compile
        with pytest.raises(RequestError, match=f"structured_outputs: .*{message}"):
            check(structured)
