"""Settings: flags, `--help` defaults and MMLANE_* variables derived from the config Structs, and
serve handing each child its validated config."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import operator
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

import msgspec
import pytest

from bench.cli import BENCH_SETTINGS, bench_parser
from bench.cli import main as bench_main
from conftest import REPO, pool_pids, processes
from mmlane.cli import ROLE_SETTINGS, build_parser, config_from_argv, main, role_config
from mmlane.common.config import default_of, usable_cores
from mmlane.common.settings import Settings, flag_name
from mmlane.engine.config import EngineConfig
from mmlane.frontend.config import FrontendConfig
from mmlane.launcher import (
    KILL_GRACE_S,
    SERVE_SETTINGS,
    ServeConfig,
    serve_config,
    sigterm_as_interrupt,
    start_roles,
    stop_all,
)
from mmlane.mm_worker.config import MMWorkerConfig
from mmlane.ops.health import ping_all
from mmlane.protocol.errors import FatalError


class Inner(msgspec.Struct, kw_only=True):
    wait_timeout_s: float = 2.5
    """How long to wait."""


class Toy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    size: int = 3
    """How big."""
    label: str | None = None
    color: Literal["red", "blue"] = "red"
    fast: bool = False
    tags: list[str] = msgspec.field(default_factory=lambda: ["a", "b"])
    inner: Inner = msgspec.field(default_factory=Inner)


TOY = Settings(Toy)


# ---------------------------------------------------------------- the derivation


@pytest.mark.parametrize(("field", "flag"), [
    ("drain_timeout_s", "drain-timeout"), ("mm_cache_gb", "mm-cache-gb"),
    ("http_port", "http-port"),
])
def test_flag_name_is_the_field_name_without_its_seconds_suffix(field: str, flag: str) -> None:
    assert flag_name(field) == flag


def test_every_field_is_a_flag_nested_ones_named_after_their_leaf() -> None:
    assert [(s.flag, s.paths) for s in TOY.settings] == [
        ("size", ["size"]), ("label", ["label"]), ("color", ["color"]), ("fast", ["fast"]),
        ("tags", ["tags"]), ("wait-timeout", ["inner.wait_timeout_s"]),
    ]


@pytest.mark.parametrize(("argv", "values"), [
    ([], {}),
    (["--size", "5", "--label", "x"], {"size": 5, "label": "x"}),
    (["--color", "blue", "--fast"], {"color": "blue", "fast": True}),
    (["--tags", "x,y", "--tags", "z"], {"tags": ["x", "y", "z"]}),
    (["--wait-timeout", "1"], {"inner": {"wait_timeout_s": 1.0}}),
])
def test_flags_give_only_what_is_set_nested_as_the_struct(argv: list[str], values: dict) -> None:
    assert TOY.parse(argv) == values


def test_settings_not_given_take_the_structs_defaults() -> None:
    assert msgspec.convert(TOY.parse([]), Toy) == Toy()


@pytest.mark.parametrize(("argv", "match"), [
    (["--color", "green"], "invalid choice"), (["--size", "big"], "invalid int value"),
    (["--colour", "red"], "unknown flags --colour red"),
])
def test_a_command_line_it_cannot_read_is_refused(argv: list[str], match: str) -> None:
    with pytest.raises(FatalError, match=match):
        TOY.parse(argv)


def test_one_flag_sets_every_leaf_of_its_name() -> None:
    config = serve_config(SERVE_SETTINGS.parse(["--model", "/m", "--drain-timeout", "3",
                                                "--mm-cache-gb", "2"]))
    assert config.engine.model == config.mm_worker.model == config.frontend.model == "/m"
    assert {c.ops.drain_timeout_s for c in config.roles().values()} == {3.0}
    assert config.engine.mm_cache_gb == config.mm_worker.mm_cache_gb == 2.0


# ---------------------------------------------------------------- precedence: flag > env > default


def test_a_flag_beats_its_environment_variable_which_beats_the_default(
    monkeypatch: pytest.MonkeyPatch, run_dir: Path
) -> None:
    monkeypatch.delenv("MMLANE_HTTP_PORT", raising=False)
    assert config_from_argv("frontend", [], run_dir).http_port == 8000
    monkeypatch.setenv("MMLANE_HTTP_PORT", "8100")
    monkeypatch.setenv("MMLANE_DRAIN_TIMEOUT", "7")
    monkeypatch.setenv("MMLANE_ALLOWED_MEDIA_DOMAINS", "Example.com,b.org")
    assert config_from_argv("frontend", [], run_dir).http_port == 8100
    assert config_from_argv("frontend", ["--http-port", "8200"], run_dir).http_port == 8200
    assert config_from_argv("engine", [], run_dir).ops.drain_timeout_s == 7.0
    worker = config_from_argv("mm-worker", [], run_dir)
    assert worker.allowed_media_domains == ["example.com", "b.org"]
    monkeypatch.setenv("MMLANE_HTTP_PORT", "")  # empty counts as unset
    assert config_from_argv("frontend", [], run_dir).http_port == 8000


def test_flags_that_are_not_one_field_keep_their_meaning(run_dir: Path) -> None:
    frontend = config_from_argv("frontend", ["--host", "0.0.0.0", "--port", "9100"], run_dir)
    assert frontend.client_endpoint == "tcp://0.0.0.0:9100"
    worker = config_from_argv("mm-worker", ["--allowed-media-schemes", "data",
                                            "--allow-http-media"], run_dir)
    assert worker.allowed_media_schemes == ["data", "http"]


# ---------------------------------------------------------------- bad values name the setting


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["engine", "--max-batch", "0"], {}, "max_batch must be positive"),
    (["frontend", "--http-port", "70000"], {}, "http_port must be 0"),
    (["frontend", "--tokenizer-cache-words", "-1"], {}, "tokenizer_cache_words must be 0 (none)"),
    (["mm-worker"], {"MMLANE_ALLOWED_MEDIA_SCHEMES": "gopher"}, "allowed_media_schemes"),
    (["serve", "--startup-timeout", "0"], {}, "startup_timeout_s must be positive"),
    (["serve", "--image-nice", "20"], {}, "image_nice must be 0 (off) to 19, got 20"),
    (["mm-worker"], {"MMLANE_IMAGE_NICE": "-1"}, "image_nice must be 0 (off) to 19, got -1"),
    (["mm-worker", "--mm-processes", "2", "--video-processes", "3"], {},
     "video_processes must be 0 (the default) or more, at most mm_processes (2) with a pool, "
     "got 3"),
    (["mm-worker", "--video-processes", "-1"], {}, "video_processes must be 0 (the default)"),
    (["frontend"], {"MMLANE_HTTP_PORT": "eighty"}, "$MMLANE_HTTP_PORT: invalid literal for int"),
])
def test_a_bad_value_names_the_setting(
    argv: list[str], env: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 1
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("mm_processes", "video_processes", "resolved"), [
    (1, 0, 2), (1, 1, 1), (1, 3, 3), (2, 0, 1), (5, 0, 2), (8, 0, 4), (4, 4, 4), (4, 1, 1),
])
def test_video_processes_are_half_the_pool_or_two_threads_unless_set(
    mm_processes: int, video_processes: int, resolved: int,
) -> None:
    config = MMWorkerConfig(mm_processes=mm_processes, video_processes=video_processes)
    assert config.video_processes == resolved


# ---------------------------------------------------------------- the HTTP API off loopback

def test_served_model_names_drop_empty_items_from_the_command_line_and_refuse_blank_ones(
    run_dir: Path
) -> None:
    """`--served-model-name a,,b` serves a and b; a config handed over whole (as `serve` hands
    its children theirs) with a blank name is refused, naming the setting."""
    names = config_from_argv("frontend", ["--served-model-name", "a,,b"], run_dir)
    assert names.served_model_name == ["a", "b"]
    with pytest.raises(msgspec.ValidationError, match="served_model_name: a name must not be"):
        msgspec.convert({"served_model_name": ["a", " "]}, FrontendConfig)


HTTP_OFF_LOOPBACK = ["--http-host", "0.0.0.0", "--http-port", "8000"]


@pytest.mark.parametrize("command", ["frontend", "serve"])
def test_http_off_loopback_without_a_key_is_refused_naming_the_ways_out(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, *HTTP_OFF_LOOPBACK]) == 1
    assert ("http_host '0.0.0.0' is not a loopback address, and without an API key anyone who "
            "reaches port 8000 can use the model: give --api-key or --api-key-file, or "
            "--insecure-http") in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "env"), [
    (["--api-key", "k1"], {}),
    (["--api-key-file", "KEYS"], {}),
    ([], {"MMLANE_API_KEY": "k1,k2"}),
    ([], {"MMLANE_API_KEY_FILE": "KEYS"}),
    (["--insecure-http"], {}),
    ([], {"MMLANE_INSECURE_HTTP": "1"}),
])
def test_http_off_loopback_is_served_with_a_key_or_insecure_http(
    argv: list[str], env: dict[str, str], run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = run_dir / "keys"
    keys.write_text("k1\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("KEYS", str(keys)))
    argv = [arg.replace("KEYS", str(keys)) for arg in argv]
    config = config_from_argv("frontend", [*HTTP_OFF_LOOPBACK, *argv], run_dir)
    assert (config.http_host, config.http_port) == ("0.0.0.0", 8000)
    assert config.api_keys() or config.insecure_http


@pytest.mark.parametrize("argv", [
    ["--http-host", "localhost", "--http-port", "8000"],
    ["--http-host", "127.0.0.2", "--http-port", "8000"],
    ["--http-host", "::1", "--http-port", "8000"],
    ["--http-host", "0.0.0.0", "--http-port", "0"],  # HTTP off
])
def test_http_on_loopback_or_off_needs_no_key(argv: list[str], run_dir: Path) -> None:
    assert config_from_argv("frontend", argv, run_dir).api_keys() == []


# ---------------------------------------------------------------- --help


def _settings(command: str) -> Settings:
    if command == "serve":
        return SERVE_SETTINGS
    if command == "bench":
        return BENCH_SETTINGS
    return ROLE_SETTINGS[command][1]


@pytest.mark.parametrize("command", ["serve", "engine", "mm-worker", "frontend", "bench"])
def test_help_shows_every_setting_with_its_default(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        if command == "bench":
            bench_main(["--help"])
        else:
            main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    settings = _settings(command).settings
    for setting in settings:
        assert f"--{setting.flag} " in text
    assert text.count("(default: ") >= len(settings)
    assert "(default: 30.0; $MMLANE_DRAIN_TIMEOUT)" in text or command == "bench"
    assert ("else from its MMLANE_* environment variable" in text) == (command != "bench")


@pytest.mark.parametrize("command", ["serve", "mm-worker"])
def test_help_says_jpeg_draft_is_off_and_not_bit_exact(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # undo the wrapping
    help_of_flag = text[text.index("--jpeg-draft Decode"):]
    assert "NOT bit-exact" in help_of_flag.partition("(default: ")[0]
    assert help_of_flag.partition("(default: ")[2].startswith("False; $MMLANE_JPEG_DRAFT)")


def test_serve_hands_jpeg_draft_to_its_mm_worker() -> None:
    assert not serve_config(SERVE_SETTINGS.parse([])).mm_worker.jpeg_draft
    assert serve_config(SERVE_SETTINGS.parse(["--jpeg-draft"])).mm_worker.jpeg_draft


def test_serve_gives_a_host_without_a_model_one_mm_process_per_core() -> None:
    """--backend vllm-remote (no model on the host, no encoder lane): the MM worker's default is
    a process per core, not one per 4; a count given, and the other backends, stay as they are."""
    cores = usable_cores()  # the affinity's, within a container's CPU limit where one is set
    remote = ["--backend", "vllm-remote", "--vllm-url", "http://127.0.0.1:9"]

    def processes(*argv: str) -> int:
        return serve_config(SERVE_SETTINGS.parse(list(argv))).mm_worker.mm_processes

    assert processes(*remote) == cores
    assert processes(*remote, "--mm-processes", "1") == 1
    assert processes(*remote, "--encoder-lane") == processes() == max(1, cores // 4)


def test_the_cores_defaults_count_are_the_affinity_s_within_a_cgroup_quota(
        tmp_path: Path) -> None:
    """A container's CPU limit (cgroup v2's cpu.max, or v1's CFS quota) bounds the cores the
    defaults count (MM processes, tokenizer threads, torch threads), rounded up; no quota, an
    unlimited one or an unreadable one leaves the affinity's."""
    cores = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path) == cores  # no cgroup files
    cpu_max = tmp_path / "cpu.max"
    for text, expected in (("max 100000\n", cores), ("150000 100000\n", min(cores, 2)),
                           ("50000 100000\n", 1), ("nonsense", cores)):
        cpu_max.write_text(text)
        assert usable_cores(tmp_path) == expected, text
    cpu_max.unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    for quota, expected in (("-1\n", cores), ("300000\n", min(cores, 3))):
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota)
        assert usable_cores(tmp_path) == expected, quota


def _commands() -> dict[str, argparse.ArgumentParser]:
    """The subcommands `mmlane --help` lists, and `python -m bench`."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    commands = {f"mmlane {action.dest}": sub.choices[action.dest]
                for action in sub._choices_actions}
    return {**commands, "python -m bench": bench_parser()}


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_shows_the_default_of_every_option_that_takes_a_value(command: str) -> None:
    """Through the parsers, not `--help`'s text: each option's own help must say its default
    (or that there is none); a switch's is off, a required option has none."""
    parser = _commands()[command]
    silent = [action.option_strings[0] for action in parser._actions
              if action.option_strings and action.nargs != 0 and not action.required
              and action.help is not argparse.SUPPRESS and "default" not in (action.help or "")]
    assert not silent, f"{command} --help shows no default for {silent}"


# ---------------------------------------------------------------- serve's children


def test_serves_child_runs_with_the_config_it_was_handed(qwen_dir: Path, run_dir: Path) -> None:
    config = serve_config(SERVE_SETTINGS.parse(
        ["--model", str(qwen_dir), "--run-dir", str(run_dir), "--drain-timeout", "4"]))
    worker = msgspec.structs.replace(
        config.mm_worker, ops=msgspec.structs.replace(config.mm_worker.ops, name="handed")
    )
    (child,) = start_roles({"mm-worker": worker}, run_dir, 180, log_dir=run_dir / "logs")
    try:
        assert child.endpoint == worker.mm_worker_endpoint
        assert child.stop_timeout_s == 4 + KILL_GRACE_S
        (answer,) = ping_all([worker.ops.control_endpoint], timeout_s=30)
        assert answer.name == "handed"
        # ... through its stdin: a command line is readable by every user (API keys!)
        command_line = Path(f"/proc/{child.process.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--config-json" in command_line and not any(b"handed" in a for a in command_line)
    finally:
        stop_all([child])


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread of process `pid`, by id: its niceness (Linux counts it per thread)."""
    return {int(task.name): os.getpriority(os.PRIO_PROCESS, int(task.name))
            for task in Path(f"/proc/{pid}/task").iterdir()}


def test_image_work_runs_image_nice_below_text_work(qwen_dir: Path, run_dir: Path) -> None:
    config = serve_config(SERVE_SETTINGS.parse(
        ["--model", str(qwen_dir), "--run-dir", str(run_dir), "--image-nice", "7",
         "--mm-processes", "2"]))
    children = start_roles({"engine": config.engine, "mm-worker": config.mm_worker}, run_dir,
                           180, log_dir=run_dir / "logs")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = min(19, base + 7)
    try:
        pids = {child.role: child.process.pid for child in children}
        # The engine: its vision lane's thread alone; text units run on others, at the start's.
        engine = thread_nices(pids["engine"])
        assert list(engine.values()).count(lowered) == 1, engine
        assert set(engine.values()) == {base, lowered}, engine
        # The MM worker: its thread that loads and processes images, and its pool processes.
        assert thread_nices(pids["mm-worker"])[pids["mm-worker"]] == lowered
        pool = pool_pids(pids["mm-worker"])
        assert len(pool) == 2
        assert all(set(thread_nices(pid).values()) == {lowered} for pid in pool)
    finally:
        stop_all(children)


def test_a_child_refuses_a_config_that_is_not_its_roles(run_dir: Path) -> None:
    with pytest.raises(FatalError, match="mm-worker exited with status 1 during startup"):
        start_roles({"mm-worker": EngineConfig()}, run_dir, 180, log_dir=run_dir / "logs")
    log = (run_dir / "logs" / "mm-worker.log").read_text()
    assert "invalid MMWorkerConfig: Object contains unknown field" in log


@pytest.mark.parametrize("attempt", range(3))
def test_a_signal_while_roles_start_leaves_no_process_running(attempt: int, run_dir: Path) -> None:
    """Under sigterm_as_interrupt (the bench's, the scripts'), SIGTERM from the first process
    the moment it runs, while start_roles starts the others: start_roles ends with
    KeyboardInterrupt, and has stopped every process it started, whatever it was doing then."""
    asleep = b"sleep\x00%d\x00" % (900 + attempt)
    sleeper = ["/bin/sh", "-c", f"exec sleep {900 + attempt}"]
    commands = {f"role-{i}": sleeper for i in range(1, 6)}
    commands["role-0"] = ["/bin/sh", "-c", f"kill -TERM $PPID; exec sleep {900 + attempt}"]
    roles = {role: MMWorkerConfig() for role in sorted(commands)}
    with pytest.raises(KeyboardInterrupt) as raised, sigterm_as_interrupt():
        start_roles(roles, run_dir, 60, log_dir=run_dir / "logs", commands=commands)
    assert raised.value.args == (signal.SIGTERM,)
    assert not [process for process in processes() if process.cmdline == asleep]


def test_mmlane_installs_as_one_package_named_mmlane(tmp_path: Path) -> None:
    """The wheel holds `mmlane` (services/) and `mmlane.protocol` (protocol/), every package
    folder of the checkout and its data, and no `services` or `protocol` of its own."""
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, source / name)
    for folder in ("services", "protocol"):
        shutil.copytree(REPO / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
                   check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheel").glob("mmlane-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"mmlane"}
    packages = {str(Path("mmlane", init.relative_to(REPO / "services")))
                for init in (REPO / "services").rglob("__init__.py")}
    assert packages | {"mmlane/protocol/__init__.py"} <= set(names)
    assert {"mmlane/common/startup/sitecustomize.py", "mmlane/model/corpus.txt",
            "mmlane/protocol/errors.py", "mmlane/cli.py"} <= set(names)


def test_the_config_json_flag_round_trips_every_role(run_dir: Path) -> None:
    config = serve_config(SERVE_SETTINGS.parse(["--run-dir", str(run_dir), "--allow-http-media"]))
    for role, handed in config.roles().items():
        json = msgspec.json.encode(handed).decode()
        assert role_config(role, build_parser().parse_args([role, "--config-json", json])) == handed



def test_malformed_config_json_is_refused_naming_the_config() -> None:
    with pytest.raises(FatalError, match="invalid EngineConfig JSON: JSON is malformed"):
        role_config("engine", build_parser().parse_args(["engine", "--config-json", "{bad"]))


def test_vllm_engine_arguments_pass_through_the_file_first_values_read_as_json(
    tmp_path: Path,
) -> None:
    args_file = tmp_path / "vllm.yaml"
    args_file.write_text("max-model-len: 2048\nenforce_eager: true\ndtype: bfloat16\n")
    engine = config_from_argv("engine", [
        "--backend", "vllm", "--vllm-args-file", str(args_file),
        "--vllm-arg", "tensor_parallel_size=2", "--vllm-arg", "dtype=float32",
        "--vllm-arg", 'limit_mm_per_prompt={"image": 4, "video": 0}',
        "--vllm-arg=--served-model-name=x",
    ], tmp_path)
    assert engine.backend == "vllm"
    assert engine.vllm.engine_args() == {
        "max_model_len": 2048, "enforce_eager": True, "dtype": "float32",
        "tensor_parallel_size": 2, "limit_mm_per_prompt": {"image": 4, "video": 0},
        "served_model_name": "x",
    }


def test_vllm_engine_arguments_in_the_environment_are_one_per_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MMLANE_VLLM_ARG",
                       'dtype=float32\nlimit_mm_per_prompt={"image": 4, "video": 0}')
    engine = config_from_argv("engine", ["--backend", "vllm"], tmp_path)
    assert engine.vllm.engine_args() == {"dtype": "float32",
                                         "limit_mm_per_prompt": {"image": 4, "video": 0}}


@pytest.mark.parametrize(("argv", "match"), [
    (["--vllm-arg", "tensor_parallel_size"], "KEY=VALUE"),
    (["--vllm-args-file", "/nonexistent/vllm.json"], "cannot read"),
])
def test_malformed_vllm_engine_arguments_are_refused_at_startup(
    tmp_path: Path, argv: list[str], match: str,
) -> None:
    with pytest.raises((FatalError, ValueError), match=match):
        config_from_argv("engine", ["--backend", "vllm", *argv], tmp_path)


@pytest.mark.parametrize(("text", "match"), [("[1, 2]", "one mapping"), ("{", "malformed")])
def test_a_vllm_args_file_must_hold_one_mapping(tmp_path: Path, text: str, match: str) -> None:
    args_file = tmp_path / "vllm.json"
    args_file.write_text(text)
    with pytest.raises((FatalError, ValueError), match=match):
        config_from_argv("engine", ["--vllm-args-file", str(args_file)], tmp_path)


# ---------------------------------------------------------------- one home per setting


_ARITHMETIC: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}
_FIELD_CALLS = {"field", "msgspec.field", "dataclasses.field"}


class Home(NamedTuple):
    """Where a setting is defined: a config Struct that a role runs with, and its default."""

    struct: type[msgspec.Struct]
    path: str
    default: Any


class Written(NamedTuple):
    """A default written in services/: a parameter's, or a class's field's (`owner`)."""

    name: str
    value: ast.expr
    where: str
    owner: str
    """The class whose field it is; "" for a parameter."""
    in_config: bool
    """A field of a config Struct (a class named *Config that derives from a Struct)."""


@functools.cache
def role_settings() -> dict[str, list[Home]]:
    """Each setting's name -> its homes: the fields of ServeConfig and of every config Struct it
    holds (each role's, each backend's, the shared ones), with their defaults."""
    homes: dict[str, list[Home]] = {}
    structs: list[type[msgspec.Struct]] = [ServeConfig]
    seen: set[type[msgspec.Struct]] = set()
    while structs:
        struct = structs.pop()
        if struct in seen:
            continue
        seen.add(struct)
        path = Path(inspect.getfile(struct)).relative_to(REPO).as_posix()
        for field in msgspec.structs.fields(struct):
            if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
                structs.append(field.type)
            if field.default is not msgspec.NODEFAULT or field.default_factory is not \
                    msgspec.NODEFAULT:
                homes.setdefault(field.name, []).append(
                    Home(struct, path, default_of(struct, field.name)))
    return homes


def literal(node: ast.expr) -> Any:
    """The value of a default written as a literal: a constant, arithmetic on constants, a
    container of literals, or `field(default=...)` or `field(default_factory=lambda: ...)` of
    one. ValueError for anything else: a name or a call takes its value from one place."""
    match node:
        case ast.Constant(value=value):
            return value
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _ARITHMETIC:
            return _ARITHMETIC[type(op)](literal(operand))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _ARITHMETIC:
            return _ARITHMETIC[type(op)](literal(left), literal(right))
        case ast.List(elts=items) | ast.Tuple(elts=items) | ast.Set(elts=items):
            return [literal(item) for item in items]
        case ast.Dict(keys=keys, values=values) if None not in keys:
            return {literal(k): literal(v) for k, v in zip(keys, values, strict=True)}  # type: ignore[arg-type]
        case ast.Call(func=func, keywords=keywords) if ast.unparse(func) in _FIELD_CALLS:
            given = {keyword.arg: keyword.value for keyword in keywords}
            if "default" in given:
                return literal(given["default"])
            if isinstance(given.get("default_factory"), ast.Lambda):
                return literal(given["default_factory"].body)  # type: ignore[union-attr]
    raise ValueError(ast.unparse(node))


def written_defaults(source: str, module: str) -> Iterator[Written]:
    """Every default written in `source`, the module at `module`: each parameter's (functions,
    methods, lambdas) and each class-body field's (dataclasses, Structs, named tuples, plain
    classes)."""
    tree = ast.parse(source, module)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults,
                          strict=True), *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            for arg, value in pairs:
                if value is not None:
                    yield Written(arg.arg, value, f"{module}:{value.lineno}", "", False)
        elif isinstance(node, ast.ClassDef):
            in_config = node.name.endswith("Config") and any(
                ast.unparse(base).endswith("Struct") for base in node.bases)
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and statement.value is not None:
                    targets, value = [statement.target], statement.value
                elif isinstance(statement, ast.Assign):
                    targets, value = statement.targets, statement.value
                else:
                    continue
                for target in targets:
                    if isinstance(target, ast.Name):
                        yield Written(target.id, value, f"{module}:{value.lineno}", node.name,
                                      in_config)


def _unset(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, list | dict) and not value)


def restates(written: Written, home: Home) -> bool:
    """Whether `written` writes `home`'s setting's default a second time.

    - Only a literal counts: a name (IMAGE_NICE) or a call (`default_of(...)`) takes the value
      from one place.
    - "Not given" on both sides (None, "", an empty list) restates nothing: what unset means is
      the setting's own code (an ipc path in the run dir, the embedded model).
    - A parameter or a plain class's field named like the setting with a compound name
      (`image_nice`, `max_unit_ms`) is the setting, whatever it defaults to: with another value
      it runs a mode no config makes (issue 40: a runner's image_nice 0 against the config's 10).
      A one-word name (`name`, `port`, `host`) is too common to mean the setting alone: it
      counts where it also repeats the setting's value.
    - A field of another config Struct is a setting's definition too: it counts where it
      repeats the value (two homes of one setting); with another value it is a setting of its
      own that shares the name (the bench's drain_timeout_s bounds a phase, not a role's drain).
    """
    if (written.owner, written.where.partition(":")[0]) == (home.struct.__name__, home.path):
        return False  # the home itself
    try:
        value = literal(written.value)
    except ValueError:
        return False
    if _unset(value) and _unset(home.default):
        return False
    if written.in_config or "_" not in written.name:
        return bool(value == home.default)
    return True


@pytest.mark.parametrize("path", [
    pytest.param(path, id=path.relative_to(REPO).as_posix())
    for path in sorted([*(REPO / "services").rglob("*.py"), *(REPO / "bench").rglob("*.py")])
])
def test_no_setting_has_its_default_written_twice(path: Path) -> None:
    found = [
        f"{written.where}: {written.owner + '.' if written.owner else ''}{written.name} = "
        f"{ast.unparse(written.value)} restates {home.struct.__name__}.{written.name} = "
        f"{home.default!r} ({home.path})"
        for written in written_defaults(path.read_text(), path.relative_to(REPO).as_posix())
        for home in role_settings().get(written.name, [])
        if restates(written, home)
    ]
    assert not found, ("a setting's default is written again; take it from its home (the config "
                       "object whole, or default_of):\n" + "\n".join(found))


@pytest.mark.parametrize(("written", "restated"), [
    ("def load(image_nice: int = 0): ...", True),  # another value: a mode no config makes
    ("def load(image_nice: int = 10): ...", True),
    ("def load(*, max_batch=16): ...", True),
    ("def load(image_nice: int = IMAGE_NICE): ...", False),  # a name: one place
    ("def load(mm_cache_gb=default_of(EngineConfig, 'mm_cache_gb')): ...", False),
    ("def serve(port: int = 0): ...", False),  # a one-word name with another value
    ("def serve(port: int = 8765): ...", True),
    ("def connect(engine_endpoint: str = ''): ...", False),  # unset on both sides
    ("class Policy:\n    jpeg_draft: bool = False", True),
    ("class Limits:\n    http_max_body_bytes: int = 128 * 1024 * 1024", True),
    ("class BenchConfig(msgspec.Struct):\n    drain_timeout_s: float = 60.0", False),
    ("class BenchConfig(msgspec.Struct):\n    tokenizer_workers: int = 4", True),
])
def test_a_default_counts_as_written_twice_by_its_name_and_literal(
    written: str, restated: bool,
) -> None:
    found = [home.struct.__name__ for default in written_defaults(written, "services/probe.py")
             for home in role_settings().get(default.name, []) if restates(default, home)]
    assert bool(found) == restated, found


def _module_file(name: str) -> Path | None:
    """The file of the project's module `name` (mmlane.protocol.* in protocol/, mmlane.* in
    services/); None for another's."""
    parts = name.split(".")
    if parts[0] != "mmlane":
        return None
    folder = ["protocol"] if parts[1:2] == ["protocol"] else ["services", *parts[1:2]]
    base = REPO.joinpath(*folder, *parts[2:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _top_level_imports(path: Path) -> Iterator[str]:
    """What the module at `path` imports as it loads: its module body's imports (those in if,
    try and with blocks too, not those under TYPE_CHECKING nor in functions), each with the
    packages above it, and `from P import M` of a submodule M as P.M."""
    def body(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
        for statement in statements:
            if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
                continue
            if isinstance(statement, ast.If | ast.Try | ast.With):
                nested = [*getattr(statement, "body", []), *getattr(statement, "orelse", []),
                          *getattr(statement, "finalbody", []),
                          *(s for h in getattr(statement, "handlers", []) for s in h.body)]
                yield from body(nested)
            else:
                yield statement

    for statement in body(ast.parse(path.read_text()).body):
        names: list[str] = []
        if isinstance(statement, ast.Import):
            names = [alias.name for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            names = [statement.module, *(f"{statement.module}.{alias.name}"
                                         for alias in statement.names
                                         if _module_file(f"{statement.module}.{alias.name}"))]
        for name in names:
            parts = name.split(".")
            yield from (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def loaded_on_import(name: str) -> set[str]:
    """Every module that importing the project's module `name` loads, as far as the project's
    own import statements tell (another package's imports are not followed)."""
    loaded, todo = set(), [name]
    while todo:
        module = todo.pop()
        if module in loaded:
            continue
        loaded.add(module)
        path = _module_file(module)
        if path is not None:
            parts = module.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages run first
            todo += _top_level_imports(path)
    return loaded


def _imports(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [node.module or ""] if not node.level else []


def test_mmlane_imports_nothing_of_the_bench() -> None:
    """bench/ is not installed: services/ or protocol/ importing it, even in a function, fails
    wherever mmlane runs from an install, not a checkout."""
    files = sorted([*(REPO / "services").rglob("*.py"), *(REPO / "protocol").rglob("*.py")])
    found = [f"{path.relative_to(REPO)}:{node.lineno}"
             for path in files for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Import | ast.ImportFrom)
             and any(name.partition(".")[0] == "bench" for name in _imports(node))]
    assert len(files) > 50 and not found, found


def test_serve_imports_no_model_code() -> None:
    """`mmlane serve` only starts and watches the roles: torch and transformers would cost it
    about 280 MB of its own for nothing (the default model is built by a child process)."""
    loaded = loaded_on_import("mmlane.launcher")
    assert "mmlane.common.model_dir" in loaded
    assert not {m for m in loaded if m.startswith(("torch", "transformers", "mmlane.model"))}


@pytest.mark.parametrize(("config", "others"), [
    ("mmlane.frontend.config", ("mmlane.mm_worker", "mmlane.engine")),
    ("mmlane.mm_worker.config", ("mmlane.frontend", "mmlane.engine")),
])
def test_a_roles_config_imports_no_other_role_and_no_model(config: str, others: tuple) -> None:
    heavy = ("torch", "transformers", "mmlane.model", *others)
    loaded = loaded_on_import(config)
    assert "mmlane.common.config" in loaded
    assert not {m for m in loaded if m.startswith(heavy)}, sorted(loaded)
