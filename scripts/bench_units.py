"""Units benchmark: what slicing an image request's prefill into bounded units costs the engine.

    python scripts/bench_units.py [--model DIR] [--device cpu] [--max-unit-ms none,5,20]
                                  [--size 1024x1024] [--requests 4] [--rounds 3]
                                  [--max-tokens 16] [--vision-threads 1] [--idle-unit-ms MS]
                                  [--prefill-chunk-tokens N] [--together]
                                  [--text-words N]

Loads `--model` (default: the embedded model) onto `--device` (default: the CPU) with one torch
thread, into one `HFRunner` per `--max-unit-ms` value (none: no budget, so a whole prompt is one
unit), and `--vision-threads` for the vision lane; `--idle-unit-ms` and `--prefill-chunk-tokens`
as the engine's (default: as --max-unit-ms; 128, 0: derived). Each round runs `--requests` chat
requests with one photo-like image of `--size` (a different image each, rendered as the MM
worker renders them; or with `--text-words`, text-only chats of that many words, each a
different text) on each runner in turn, one request at a time, and prints per request: the wall
time and, from the runner's own account, the units and milliseconds of each kind (vision: whole
passes on the vision lane; prefill; decode), the milliseconds from its arrival to its first
token, and the prefill forwards that took several requests' chunks. Rounds alternate the runners
so that the machine's drift hits each alike. Without `--together` no unit waits for another
request, so a unit takes the idle budget (with `--text-words`, only once no other text request
has arrived for budget.QUIET_S, so units stay small there): what the units cost is their
number and each one's overhead, not the scheduling. With it, a round's requests arrive at
once, and a unit may take chunks of several (HFRunner._across). Asserts nothing.
"""

from __future__ import annotations

import argparse
import time

from protocol.messages import EngineRequest, MMJob, SamplingParams
from services.bench.images import make_image
from services.engine.hf.config import PREFILL_CHUNK_TOKENS
from services.engine.hf.runner import HFRunner
from services.mm_worker.render import PreparedImage, render_request
from services.model import Preprocessor, load_preprocessor, resolve_model_dir


def image_requests(prep: Preprocessor, count: int, size: tuple[int, int],
                   max_tokens: int) -> list[EngineRequest]:
    """`count` chats of one image each (seeds 0..count-1), rendered as the MM worker does."""
    prompt = prep.render_prompt([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}])
    [token_ids] = prep.tokenize_batch([prompt])
    sampling = SamplingParams(max_tokens=max_tokens)
    return [
        render_request(
            MMJob(request_id=f"u{seed}", reply_to="", prompt_token_ids=token_ids, images=[],
                  sampling=sampling),
            [PreparedImage.processed("", prep.process_image(make_image(*size, seed=seed)))],
            prep)
        for seed in range(count)
    ]


def text_requests(prep: Preprocessor, count: int, words: int,
                  max_tokens: int) -> list[EngineRequest]:
    """`count` text-only chats of `words` numbered words each, all different from the first."""
    sampling = SamplingParams(max_tokens=max_tokens)
    requests = []
    for number in range(count):
        text = f"{number}: " + " ".join(f"word{index}" for index in range(words))
        prompt = prep.render_prompt([{"role": "user", "content": [
            {"type": "text", "text": text}]}])
        [token_ids] = prep.tokenize_batch([prompt])
        requests.append(EngineRequest(request_id=f"t{number}", reply_to="",
                                      prompt_token_ids=token_ids, sampling=sampling))
    return requests


def run_round(runner: HFRunner, requests: list[EngineRequest], *,
              together: bool) -> dict[str, float]:
    """Run the requests to their ends, one at a time or all added at once: per request, the
    wall ms, the ms to its first token and each kind's units and ms; and the prefill forwards
    that took several requests' chunks."""
    before = {name: (h.count, h.total) for name, h in runner.metrics.histograms.items()}
    across = runner.metrics.counters["prefill_forwards_across_requests"]
    numbered = list(enumerate(requests))
    arrivals = [numbered] if together else [[pair] for pair in numbered]
    first_token_s: dict[int, float] = {}
    started = time.perf_counter()
    for arrival in arrivals:
        added = time.perf_counter()
        for handle, request in arrival:
            runner.add(handle, request)
        while runner.has_work():
            for output in runner.step():
                first_token_s.setdefault(output.handle, time.perf_counter() - added)
    figures = {"wall ms": (time.perf_counter() - started) * 1e3 / len(requests),
               "first token ms": sum(first_token_s.values()) * 1e3 / len(requests),
               "forwards across requests":
                   runner.metrics.counters["prefill_forwards_across_requests"] - across}
    for name, histogram in sorted(runner.metrics.histograms.items()):
        if name.startswith("engine_step:"):
            count, total = before.get(name, (0, 0.0))
            kind = name.split(":")[1]
            figures[f"{kind} units"] = (histogram.count - count) / len(requests)
            figures[f"{kind} ms"] = (histogram.total - total) * 1e3 / len(requests)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model directory (default: the embedded model)")
    parser.add_argument("--device", default="cpu", help="as the engine's --device")
    parser.add_argument("--max-unit-ms", default="none,5,20",
                        help="comma-separated budgets, 'none' for no budget")
    parser.add_argument("--size", default="1024x1024", help="the images' WIDTHxHEIGHT")
    parser.add_argument("--requests", type=int, default=4, help="requests per round")
    parser.add_argument("--text-words", type=int, default=0,
                        help="text-only requests of this many words instead of images")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16, help="of each request")
    parser.add_argument("--vision-threads", type=int, default=1,
                        help="as the engine's --vision-threads (0: as its torch threads)")
    parser.add_argument("--idle-unit-ms", type=float, default=None,
                        help="as the engine's (default: as --max-unit-ms)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=PREFILL_CHUNK_TOKENS,
                        help="as the engine's (default: %(default)s; 0: derived from "
                             "--max-unit-ms)")
    parser.add_argument("--together", action="store_true",
                        help="a round's requests arrive at once (default: one at a time)")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    prep = load_preprocessor(model_dir)
    width, height = (int(side) for side in args.size.split("x"))
    requests = (
        text_requests(prep, args.requests, args.text_words, args.max_tokens) if args.text_words
        else image_requests(prep, args.requests, (width, height), args.max_tokens))
    runners = {
        budget: HFRunner.load(str(model_dir), args.device, threads=1,
                              vision_threads=args.vision_threads,
                              max_unit_ms=None if budget == "none" else float(budget),
                              idle_unit_ms=args.idle_unit_ms,
                              prefill_chunk_tokens=args.prefill_chunk_tokens or None)
        for budget in args.max_unit_ms.split(",")
    }
    for runner in runners.values():
        run_round(runner, requests[:1], together=False)  # warm up
    for round_number in range(1, args.rounds + 1):
        for budget, runner in runners.items():
            figures = run_round(runner, requests, together=args.together)
            print(f"round {round_number}, max_unit_ms {budget}: " + ", ".join(
                f"{name} {value:.0f}" for name, value in figures.items()))


if __name__ == "__main__":
    main()
