"""Decode benchmark: batched decode steps against one request per step, in process.

    python scripts/bench_decode.py [--concurrency 1,4,8,16] [--max-batch 1,16]
                                   [--max-tokens 64] [--repeats 3] [--torch-threads 0]

Loads the embedded model into one `HFRunner` per `--max-batch` value (1: a decode step runs one
request, as before batching) and, for each `--concurrency` C, adds C text-only chat requests at
once (different questions, rendered and tokenized as the frontend does, greedy, `--max-tokens`
each) and steps the runner until all have finished. From the runner's own account it prints the
decode steps' throughput (decode tokens over the time spent in decode steps), the mean time of a
decode step and the mean number of requests in one. Each figure is the median of `--repeats`
runs, after one run to warm up. Prefill units are not counted. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics

from mmlane.common.stats import Metrics
from mmlane.engine.config import HFConfig
from mmlane.engine.hf.runner import HFRunner
from mmlane.model import Preprocessor, load_preprocessor, resolve_model_dir
from mmlane.protocol.messages import EngineRequest, SamplingParams


def text_requests(prep: Preprocessor, count: int, max_tokens: int) -> list[EngineRequest]:
    prompts = [
        prep.render_prompt([{"role": "user", "content": f"Quick question number {i}?"}])
        for i in range(count)
    ]
    return [
        EngineRequest(request_id=f"q{i}", reply_to="", prompt_token_ids=ids,
                      sampling=SamplingParams(max_tokens=max_tokens))
        for i, ids in enumerate(prep.tokenize_batch(prompts))
    ]


def decode_run(runner: HFRunner, requests: list[EngineRequest]) -> tuple[float, float, float]:
    """Run `requests` together to completion: decode tokens/s, ms per decode step, mean batch."""
    runner.metrics = Metrics("engine", "bench")  # a fresh account for this run
    for handle, request in enumerate(requests):
        runner.add(handle, request)
    while runner.has_work():
        runner.step()
    steps = runner.metrics.histograms["engine_step:decode"]
    tokens = runner.metrics.counters["decode_tokens"]
    return tokens / steps.total, steps.total / steps.count * 1e3, tokens / steps.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,4,8,16",
                        help="comma-separated numbers of requests run together")
    parser.add_argument("--max-batch", default="1,16", help="comma-separated runner settings")
    parser.add_argument("--max-tokens", type=int, default=64, help="of each request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="as the engine's --torch-threads (0: all cores but two, at least 1)")
    args = parser.parse_args()
    model_dir = resolve_model_dir(None)
    prep = load_preprocessor(model_dir)
    print(f"{'max_batch':>9} {'requests':>8} {'decode tok/s':>12} {'ms/step':>8} {'batch':>6}")
    for max_batch in (int(m) for m in args.max_batch.split(",")):
        runner = HFRunner.load(str(model_dir), HFConfig(device="cpu", max_batch=max_batch,
                                                        torch_threads=args.torch_threads))
        for count in (int(c) for c in args.concurrency.split(",")):
            requests = text_requests(prep, count, args.max_tokens)
            decode_run(runner, requests)  # warm up
            runs = [decode_run(runner, requests) for _ in range(args.repeats)]
            rate, step_ms, batch = (statistics.median(column) for column in zip(*runs, strict=True))
            print(f"{runner.max_batch:>9} {count:>8} {rate:>12.0f} {step_ms:>8.2f} {batch:>6.1f}")


if __name__ == "__main__":
    main()
