"""The `mmlane` command: one subcommand per role, the launcher, the client and the model builder."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from mmlane.common import cpu_wheels
from mmlane.common.config import (
    DEFAULT_HOST,
    default_run_dir,
    handed_config,
    load_config,
    run_dir_defaults,
)
from mmlane.common.lifecycle import run_role
from mmlane.common.settings import Settings
from mmlane.engine.config import EngineConfig
from mmlane.frontend.config import DEFAULT_PORT, FrontendConfig
from mmlane.launcher import SERVE_SETTINGS
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.protocol.errors import MMLaneError

ROLE_SETTINGS: dict[str, tuple[type[msgspec.Struct], Settings]] = {
    "engine": (EngineConfig, Settings(EngineConfig)),
    "mm-worker": (MMWorkerConfig, Settings(MMWorkerConfig)),
    "frontend": (FrontendConfig, Settings(FrontendConfig)),
}
"""Each role's config type, and the flags derived from it."""


def _add_role_args(p: argparse.ArgumentParser, settings: Settings) -> None:
    settings.add_to(p)
    p.add_argument("--ready-endpoint", help=argparse.SUPPRESS)  # set by `mmlane serve`
    # set by `mmlane serve`: the whole validated config, as msgspec JSON, or "-": read it from
    # stdin (serve's way: a command line is visible to every user); the flags are then unused
    p.add_argument("--config-json", help=argparse.SUPPRESS)


def role_config(role: str, args: argparse.Namespace) -> msgspec.Struct:
    """ROLE's validated config: the one serve handed it, else the one its flags give."""
    config_type, settings = ROLE_SETTINGS[role]
    if args.config_json:
        return handed_config(config_type, args.config_json)
    return load_config(config_type, settings.values(args))


def config_from_argv(role: str, argv: Sequence[str], run_dir: Path) -> msgspec.Struct:
    """The validated config `mmlane ROLE ARGV` runs with, as a child that `start_roles` starts in
    `run_dir` ($MMLANE_RUN_DIR) builds it: for tests and scripts that start roles by flags."""
    with run_dir_defaults(run_dir):
        return role_config(role, build_parser().parse_args([role, *argv]))


def _lazy(target: str) -> Callable[[argparse.Namespace], int]:
    """The command function `target` ('module:function'), imported only when it runs: each
    command loads its own dependencies (torch, aiohttp, rich), not every command's."""

    def run(args: argparse.Namespace) -> int:
        module, _, function = target.partition(":")
        command: Callable[[argparse.Namespace], int] = getattr(
            importlib.import_module(module), function
        )
        return command(args)

    return run


MM_WORKER_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}
"""The MM worker's torch work (the torchvision image processor's resize and patch layout) comes
in bursts between Python steps, and OpenMP's threads spin between them by default: beside
vLLM on 2 cores, its second thread took 11 ms of CPU per 1024x1024 image (the FIFO thread 15).
Passive, they sleep: a 1024x1024 image's processor took 7.2 ms of CPU with 2 threads as with
1, in 5.4 ms against 7.2 (13.4 ms of CPU spinning). Pool processes run 1 thread each."""


def _cmd_role(role: str, module: str, name: str, environment: dict[str, str] | None = None,
              *, torch: bool = True) -> Callable[[argparse.Namespace], int]:
    """Run ROLE, the class `name` of `module` built from its config, with `environment`'s
    variables set where the user's environment has not (before the module imports torch,
    whose OpenMP runtime reads them once, as it loads). Without `torch`, the role runs with
    torch hidden (`_hide_torch`)."""

    def run(args: argparse.Namespace) -> int:
        for key, value in (environment or {}).items():
            os.environ.setdefault(key, value)
        if not torch:
            _hide_torch()
        # Every role imports transformers' image processors, which import torchvision: a vLLM
        # CPU install's fails beside CPU torch until fixed, here and in the processes the role
        # starts (the MM worker's pool, vLLM's): cpu_wheels.py.
        os.environ.update(cpu_wheels.child_env())
        config = role_config(role, args)
        service = getattr(importlib.import_module(module), name)
        return run_role(role, lambda: service(config), args.ready_endpoint, config.ops)  # type: ignore[attr-defined]

    return run


def _hide_torch() -> None:
    """Make `import torch` fail in this process (unless it is loaded already). The frontend
    needs transformers' tokenizers and chat templates, never torch, but transformers imports
    torch wherever it is installed; hidden, transformers runs without it, and the frontend
    holds about 280 MB less (docs/ARCHITECTURE.md, "Memory")."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"


def _add_watch_args(p: argparse.ArgumentParser, kind: str) -> None:
    """Which processes an operator tool talks to (services/ops/discovery.py)."""
    g = p.add_argument_group(
        "which processes (default: every one whose socket is found under the run dir)"
    )
    g.add_argument(
        "--connect", action="append", default=[], metavar="ADDR",
        help=f"a process's {kind} socket, e.g. ipc:///tmp/mmlane/{kind}-engine.sock or "
        f"tcp://HOST:PORT (repeatable; default: every {kind}-*.sock under --run-dir)",
    )
    g.add_argument(
        "--run-dir", default=str(default_run_dir()), metavar="DIR",
        help="the folder searched, recursively, for the sockets (default: $MMLANE_RUN_DIR or "
        "/tmp/mmlane, here %(default)s; `mmlane serve` puts its own in serve-PORT there)",
    )


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    cpu_wheels.apply()  # before transformers imports torchvision (vLLM CPU install: cpu_wheels.py)
    from mmlane.model.tiny import build_tiny_model

    out = build_tiny_model(args.out, family=args.family, seed=args.seed)
    print(out)
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from mmlane.common.sockets import write_keys

    try:
        for path in write_keys(Path(args.out), args.name):
            print(path)
    except OSError as exc:  # an existing pair, an unwritable folder
        print(f"mmlane keys: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `mmlane` parser."""
    parser = argparse.ArgumentParser(
        prog="mmlane",
        description="Multi-process preprocessing for vision-language model serving: the frontend "
        "tokenizes text, a FIFO MM worker preprocesses images, the engine runs the model.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int] | str, help_: str) -> Any:
        """A subcommand running `func`, or the 'module:function' it names (see `_lazy`)."""
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=_lazy(func) if isinstance(func, str) else func)
        return p

    p = add("serve", "mmlane.launcher:serve",
            "run frontend, MM worker and engine on this machine")
    SERVE_SETTINGS.add_to(p)

    p = add("frontend", _cmd_role("frontend", "mmlane.frontend.service", "Frontend", torch=False),
            "run one frontend (client API, chat template, tokenizer)")
    _add_role_args(p, ROLE_SETTINGS["frontend"][1])

    p = add("mm-worker", _cmd_role("mm-worker", "mmlane.mm_worker.worker", "MMWorker",
                                        MM_WORKER_ENVIRONMENT),
            "run one MM worker (FIFO image preprocessing)")
    _add_role_args(p, ROLE_SETTINGS["mm-worker"][1])

    p = add("engine", _cmd_role("engine", "mmlane.engine", "Engine"),
            "run the engine (the model, on CUDA when present, else CPU)")
    _add_role_args(p, ROLE_SETTINGS["engine"][1])

    p = add("chat", "mmlane.client:chat_command",
            "send one chat request to a running mmlane and print the reply")
    p.add_argument("prompt", help="the user message")
    p.add_argument(
        "--endpoint", default=f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="native API address (default: serve's default)",
    )
    p.add_argument(
        "--image", action="append", default=[], metavar="PATH_OR_URL",
        help="an image: a local path (read here and sent inline) or a data:/file:// URL; "
        "repeatable (default: none)",
    )
    p.add_argument(
        "--video", action="append", default=[], metavar="PATH_OR_URL",
        help="a video: a local path (read here and sent inline) or a data:/file:// URL; "
        "repeatable (default: none)",
    )
    p.add_argument("--video-fps", type=float,
                   help="frames per second kept of each video (default: the server's)")
    p.add_argument("--video-frames", type=int,
                   help="most frames kept of each video (default: the server's)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens to generate (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default %(default)s: greedy)")
    p.add_argument("--seed", type=int, help="sampling seed (default: none)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the reply (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")

    p = add("reset-cache", "mmlane.client:reset_cache_command",
            "empty the feature caches of a running mmlane (engine and MM workers)")
    p.add_argument(
        "--endpoint", default=f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}",
        help="native API address (default: serve's default)",
    )
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the reply (default %(default)s)")

    p = add("stats", "mmlane.ops.stats_cli:stats_command",
            "print the stats the running processes publish")
    p.description = (
        "Print the Stats snapshots the running processes publish: one line per snapshot as they "
        "come, or (--once) one snapshot per process, exiting 1 if a process sends none in "
        "time."
    )
    p.add_argument("--once", action="store_true",
                   help="print one snapshot per process and exit (1 if one sent none in time)")
    p.add_argument("--json", action="store_true",
                   help='with --once, exactly one JSON object {"processes": [...], "silent": '
                   "[...]}, processes in pipeline order; without, one JSON object per line")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="with --once, seconds to wait for every process's snapshot (default 5)")
    _add_watch_args(p, "stats")

    p = add("top", "mmlane.ops.top:top_command",
            "watch every process and the latency of every lane, live")
    p.description = (
        "Watch every process (state, uptime, in-flight requests, queue depths, requests/s, "
        "errors) and every lane's latency (p50/p90/p99 over the last window, i.e. between a "
        "process's two latest snapshots, and since start), live. A process that stops "
        "publishing shows as stale. Ctrl-C quits. Into a pipe or a file: the view as plain "
        "text every --interval."
    )
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between two screen updates (default 1)")
    p.add_argument("--once", action="store_true",
                   help="wait for two snapshots of every process, print the view as plain text "
                   "and exit (1 if a process sent nothing)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="with --once, the longest wait for those snapshots (default 5)")
    _add_watch_args(p, "stats")

    p = add("health", "mmlane.ops.health:health_command",
            "ping every process; exit 0 only if all serve")
    p.description = (
        "Ping every process's control socket at once and print a line per process. Exit 0 "
        "only if each answers within --timeout, is serving, and (engines) has its model "
        "loaded, and, when the sockets are discovered (no --connect), a frontend, an MM worker "
        "and an engine all answer. Else exit 1, naming what is wrong."
    )
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="seconds to wait for the answers (default 5)")
    _add_watch_args(p, "control")

    p = add("exporter", "mmlane.ops.exporter:exporter_command",
            "serve the processes' stats to Prometheus")
    p.description = (
        "Serve the latest stats of every process to Prometheus at http://HOST:PORT/metrics: "
        "mmlane_<lane>_seconds histograms, mmlane_<counter>_total, mmlane_errors_total and "
        "mmlane_http_refused_total counters, mmlane_queue_depth, mmlane_in_flight, "
        "mmlane_uptime_seconds and mmlane_up gauges, labelled by role and name. Runs until "
        "SIGINT or SIGTERM."
    )
    p.add_argument("--port", type=int, default=9400, help="HTTP port (default 9400)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="HTTP host (default %(default)s; 0.0.0.0 to let a remote Prometheus in)")
    _add_watch_args(p, "stats")

    p = add(
        "tiny-model", _cmd_tiny_model, "write the embedded tiny model (built offline) to a folder"
    )
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--family", default="qwen2_vl",
                   choices=["qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "llava_onevision",
                            "mistral3", "internvl", "idefics3", "smolvlm"],
                   help="model architecture (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights (default %(default)s)")

    p = add("keys", _cmd_keys, "write a role's CURVE key pair (for --curve-keys)")
    p.description = (
        "Write a new ZMQ CURVE key pair for role NAME into DIR: NAME.key (the public key, for "
        "the peers that accept it) and NAME.key_secret (0600; only this role's hosts). A role "
        "given --curve-keys DIR uses DIR/ROLE.key_secret as its own key, accepts every *.key "
        "in DIR, and connects to a role R expecting R.key. An existing pair is never "
        "overwritten."
    )
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the folder (made 0700 if new)")
    p.add_argument("--name", required=True, metavar="ROLE",
                   help="the role: engine, mm-worker or frontend (the file names' stem)")

    return parser


EXIT_BROKEN_PIPE = 128 + 13
"""The status of a command whose reader closed its output (`mmlane top --once | head -1`): what
a shell reports for `cat` or `git log`, killed there by SIGPIPE (13). Not 0: what the command
would have said, and its status, is lost, and `set -o pipefail` sees that as it does for them."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _run(argv)
    except BrokenPipeError:
        # Python flushes stdout again at exit, which would fail again, loudly: point it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)  # --help prints here
    try:
        return args.func(args)
    except MMLaneError as exc:
        print(f"mmlane {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
