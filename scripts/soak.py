"""Soak: minutes of mixed load on `mmlane serve`, sampling each role's RSS and open fds.

    python scripts/soak.py [--minutes 10] [--clients 4] [--sample-s 5] [--caches small|default]
                           [--serve-arg=ARG ...] [--out soak]
    python scripts/soak.py --chart-of after=soak.json --chart-of before=old.json --out both

Runs `mmlane serve` on the embedded model with small caches (so that they are full early;
`--caches default`: its own defaults) and its HTTP API, ARGs added, and sends from `--clients`
threads (full rate: as many as keep the cores busy, 16 on two cores), until the time is up, a
seeded mix of:
text chats; chats with a new image (a new picture each time) and with a repeated one (one of a
few: feature and encoder cache hits); streams abandoned after their first event;
requests whose client gives up before the answer (a cancel downstream); bad input (a broken
image, an unknown model, invalid JSON, a negative max_tokens); a slow client whose request
head never completes (the frontend's --http-header-timeout cuts it off). Every request must get
exactly its one expected answer: the counts of the unexpected ones are printed (and fail the
run). Every `--sample-s`, it reads each role's RSS and open fds from /proc (the processes are
found by their stats, as `mmlane top` finds them), its anonymous memory (the heap, tensors)
apart from its files' pages (libraries) from smaps_rollup; from the stats, what glibc's heaps
hold (in use, free but kept, mapped apart) and the caches' evictions (a cache that evicts is
full).

Prints, per role, RSS, anonymous memory and fds at the start of the last ten minutes (of the
second half, in a run of ten minutes or less: the caches are full by then) and at the end, and
their growth over that window; the requests answered per second; writes OUT.json (every
sample) and OUT.png (the curves). Asserts nothing about the figures: read them (BENCHMARKS.md
has a run's). With `--chart-of LABEL=OUT.json` (repeatable) it runs nothing and draws those
runs' curves on one chart, OUT.png, a line style per run: e.g. a setting's run before and after.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import serving

from bench.images import jpeg_uri
from mmlane.common.sockets import free_tcp_port
from mmlane.ops.discovery import Targets
from mmlane.ops.feed import StatsFeed

SMALL_CACHES = ["--mm-cache-gb", "0.05", "--encoder-cache-gb", "0.05"]
"""Caches of 50 MiB each, full within the first minutes of this load."""
SERVE_ARGS = ["--request-timeout", "120"]
WINDOW_S = 600.0
"""The window the growth is measured over: the last ten minutes (issue 44's goal)."""
REPEATED = 4
"""Images sent again and again (the rest are new each time)."""


class Load:
    """The clients: each picks its next action by a seeded draw, until the deadline."""

    def __init__(self, http_port: int, model: str, seed: int) -> None:
        self._port, self._model = http_port, model
        self._seed = seed
        self.outcomes: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._repeated = [jpeg_uri(640, 480, 1000 + i) for i in range(REPEATED)]
        self.actions: dict[str, tuple[float, Callable[[random.Random], str]]] = {
            "text": (4, self._text),
            "new image": (2, self._new_image),
            "repeated image": (3, self._repeated_image),
            "abandoned stream": (1, self._abandoned_stream),
            "client gives up": (1, self._gives_up),
            "bad input": (1, self._bad_input),
            "slow head": (0.2, self._slow_head),
        }

    def run(self, clients: int, deadline: float) -> None:
        threads = [threading.Thread(target=self._client, args=(i, deadline), name=f"client-{i}")
                   for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _client(self, index: int, deadline: float) -> None:
        rng = random.Random(self._seed * 1000 + index)
        names = list(self.actions)
        weights = [self.actions[name][0] for name in names]
        while time.monotonic() < deadline:
            name = rng.choices(names, weights)[0]
            try:
                outcome = self.actions[name][1](rng)
            except Exception as exc:  # an answer we did not expect, or none
                outcome = f"UNEXPECTED {type(exc).__name__}: {exc}"
            with self._lock:
                self.outcomes[f"{name}: {outcome}"] += 1
                if outcome.startswith("UNEXPECTED"):
                    self.unexpected[f"{name}: {outcome}"] += 1

    # ------------------------------------------------------------ the actions

    def _post(self, body: dict[str, Any] | bytes, timeout_s: float = 120) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=timeout_s)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            connection.request("POST", "/v1/chat/completions", data,
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            return reply.status, reply.read()
        finally:
            connection.close()

    def _chat(self, content: Any, max_tokens: int = 4) -> dict[str, Any]:
        return {"model": self._model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}

    def _expect(self, status: int, reply: bytes, wanted: int) -> str:
        if status != wanted:
            raise AssertionError(f"HTTP {status}, not {wanted}: {reply[:200]!r}")
        return str(status)

    def _image(self, url: str) -> list[dict[str, Any]]:
        return [{"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is in it?"}]

    def _text(self, rng: random.Random) -> str:
        return self._expect(*self._post(self._chat(f"question {rng.random()}")), 200)

    def _new_image(self, rng: random.Random) -> str:
        width, height = rng.choice([(320, 240), (640, 480), (1024, 768), (200, 900)])
        url = jpeg_uri(width, height, rng.randrange(1 << 30))
        return self._expect(*self._post(self._chat(self._image(url))), 200)

    def _repeated_image(self, rng: random.Random) -> str:
        return self._expect(*self._post(self._chat(self._image(rng.choice(self._repeated)))),
                            200)

    def _abandoned_stream(self, rng: random.Random) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=120)
        try:
            body = {**self._chat(f"tell me a story {rng.random()}", 64), "stream": True}
            connection.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            first = reply.readline()
            if reply.status != 200 or not first.startswith(b"data: "):
                raise AssertionError(f"HTTP {reply.status}: {first[:200]!r}")
            return "first event, then closed"
        finally:
            connection.close()

    def _gives_up(self, rng: random.Random) -> str:
        try:
            status, reply = self._post(self._chat(f"a long answer {rng.random()}", 64),
                                       timeout_s=rng.uniform(0.01, 0.3))
        except (TimeoutError, OSError):
            return "gave up"
        return self._expect(status, reply, 200)  # answered before the client gave up

    def _bad_input(self, rng: random.Random) -> str:
        bad: list[tuple[Any, int]] = [
            (self._chat(self._image("data:image/png;base64,bm90IGFuIGltYWdl")), 400),
            ({**self._chat("hi"), "model": "no-such-model"}, 404),
            (b"{not json", 400),
            ({**self._chat("hi"), "max_tokens": -1}, 400),
        ]
        body, wanted = rng.choice(bad)
        return self._expect(*self._post(body), wanted)

    def _slow_head(self, rng: random.Random) -> str:
        with socket.create_connection(("127.0.0.1", self._port), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n")
            answer = sock.recv(65536)  # the 408, when the header timeout has passed
        return self._expect(int(answer.split()[1]), answer, 408)


def _proc(pid: int) -> tuple[float, float, int]:
    """A process's RSS and its anonymous part in MiB, and its open fds, from /proc."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in rollup
               if line.split(":")[0] in ("Rss", "Anonymous")}
    return kib["Rss"] / 1024, kib["Anonymous"] / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def sample(feed: StatsFeed, started: float) -> dict[str, Any]:
    """One sample of every role: RSS, fds, and the counters that say its caches are full."""
    feed.receive_for(0.5)
    roles: dict[str, Any] = {}
    for process in feed.ordered():
        if process.latest is None:
            continue
        rss, anonymous, fds = _proc(process.latest.pid)
        roles[process.name] = {"rss_mib": round(rss, 1), "anon_mib": round(anonymous, 1),
                               "fds": fds, "heap_mib": {
            kind.removeprefix("heap_"): round(size / 2**20, 1)
            for kind, size in process.latest.memory.items() if kind.startswith("heap_")},
                               "caches": {
            name: value for name, value in process.latest.counters.items()
            if "cache" in name and (name.endswith("_bytes") or name.endswith("evictions"))}}
    return {"t_s": round(time.monotonic() - started, 1), "roles": roles}


def report(samples: list[dict[str, Any]], load: Load, out: Path) -> None:
    last = samples[-1]
    start_s = last["t_s"] - WINDOW_S if last["t_s"] > WINDOW_S else last["t_s"] / 2
    first = next(s for s in samples if s["t_s"] >= start_s)
    print(f"\nfrom {first['t_s']:.0f} s to {last['t_s']:.0f} s:")
    print(f"{'role':<24} {'RSS MiB':>8} {'end':>8} {'growth':>7}   {'anon MiB':>8} {'end':>8} "
          f"{'growth':>7}   {'fds':>4} {'end':>4} {'max':>4}   heap at the end (MiB)")
    for name, end in last["roles"].items():
        begin = first["roles"].get(name, end)
        peak = max(s["roles"][name]["fds"] for s in samples if name in s["roles"])
        print(f"{name:<24} {begin['rss_mib']:>8.1f} {end['rss_mib']:>8.1f} "
              f"{_growth(begin['rss_mib'], end['rss_mib']):>7}   {begin['anon_mib']:>8.1f} "
              f"{end['anon_mib']:>8.1f} {_growth(begin['anon_mib'], end['anon_mib']):>7}   "
              f"{begin['fds']:>4} {end['fds']:>4} {peak:>4}   "
              + " ".join(f"{kind} {size:.0f}" for kind, size in end["heap_mib"].items()))
        for counter, value in end["caches"].items():
            print(f"    {counter}: {value / 2**20:.1f} MiB" if counter.endswith("_bytes")
                  else f"    {counter}: {value} (from {begin['caches'].get(counter, 0)})")
    total = sum(role["rss_mib"] for role in last["roles"].values())
    answered = sum(load.outcomes.values())
    print(f"\nthe tree: {total:.0f} MiB at the end; {answered} requests, "
          f"{answered / max(last['t_s'], 1e-9):.1f}/s")
    print("\nrequests:")
    for outcome, count in sorted(load.outcomes.items()):
        print(f"  {count:6d}  {outcome}")
    out.with_suffix(".json").write_text(json.dumps(
        {"samples": samples, "outcomes": dict(load.outcomes)}, indent=1))
    chart({"": samples}, out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _growth(begin: float, end: float) -> str:
    return f"{(end - begin) / begin * 100:+.1f}%" if begin else "-"


def chart(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Each role's RSS on a panel of its own (a role's growth shows at its own scale) and every
    role's fds on the last, a colour per role and a line style per run (its samples, under its
    label); roles are matched across runs by their name without the pid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def role(name: str) -> str:
        return name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name

    roles = list(dict.fromkeys(role(name) for samples in runs.values()
                               for name in samples[-1]["roles"]))
    figure, panels = plt.subplots(len(roles) + 1, 1, figsize=(9, 2.2 * (len(roles) + 1)),
                                  sharex=True)
    fds = panels[-1]
    for style, (label, samples) in zip(("-", "--", ":", "-."), runs.items(), strict=False):
        for name in samples[-1]["roles"]:
            index = roles.index(role(name))
            points = [(s["t_s"] / 60, s["roles"][name]) for s in samples if name in s["roles"]]
            minutes = [t for t, _ in points]
            legend = f"{role(name)} ({label})" if label else name
            panels[index].plot(minutes, [r["rss_mib"] for _, r in points], style,
                               color=f"C{index}", label=legend)
            fds.plot(minutes, [r["fds"] for _, r in points], style, color=f"C{index}")
    for index, name in enumerate(roles):
        panels[index].set_ylabel(f"{name}\nRSS (MiB)")
        panels[index].legend(loc="lower right", fontsize="small")
    fds.set_ylabel("open fds")
    fds.set_xlabel("minutes of mixed load")
    panels[0].set_title("mmlane serve under mixed load (scripts/soak.py)")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    parser.add_argument("--clients", type=int, default=4, help="client threads")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--seed", type=int, default=0, help="seeds the mix of actions")
    parser.add_argument("--caches", choices=["small", "default"], default="small",
                        help="small: 50 MiB caches, full early; default: mmlane serve's own")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="added to mmlane serve's arguments (repeatable; "
                             "--serve-arg=--flag for one that starts with -)")
    parser.add_argument("--out", type=Path, default=Path("soak"),
                        help="OUT.json and OUT.png are written")
    parser.add_argument("--chart-of", action="append", default=[], metavar="LABEL=JSON",
                        help="run nothing: draw these earlier runs (their OUT.json) on one "
                             "chart, OUT.png (repeatable; up to four)")
    args = parser.parse_args()
    if args.chart_of:
        runs = {}
        for spec in args.chart_of:
            label, _, run = spec.partition("=")
            if not run or not Path(run).is_file():
                parser.error(f"--chart-of {spec!r}: give LABEL=PATH to a soak's OUT.json")
            runs[label] = json.loads(Path(run).read_text())["samples"]
        if len(runs) > 4:
            parser.error("--chart-of: up to four runs")
        chart(runs, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
        return
    caches = SMALL_CACHES if args.caches == "small" else []
    http_port = free_tcp_port()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        with serving(run_dir, "--http-port", str(http_port), *SERVE_ARGS, *caches,
                     *args.serve_arg, log_dir=run_dir / "logs"), \
                StatsFeed(Targets("stats", (), run_dir)) as feed:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models") as reply:
                model = json.load(reply)["data"][0]["id"]
            load = Load(http_port, model, args.seed)
            started = time.monotonic()
            deadline = started + args.minutes * 60
            # A daemon (so are the clients it starts): SIGTERM or Ctrl-C ends the soak at once.
            loader = threading.Thread(target=load.run, args=(args.clients, deadline), daemon=True)
            loader.start()
            samples = [sample(feed, started)]
            while loader.is_alive():
                loader.join(args.sample_s)
                samples.append(sample(feed, started))
                print(f"{samples[-1]['t_s']:7.1f} s  " + "  ".join(
                    f"{name} {r['rss_mib']:.0f} MiB {r['fds']} fds"
                    for name, r in samples[-1]["roles"].items()), flush=True)
    report(samples, load, args.out)
    if load.unexpected:
        print(f"\n{sum(load.unexpected.values())} unexpected answers:", file=sys.stderr)
        for outcome, count in load.unexpected.most_common():
            print(f"  {count:6d}  {outcome}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
