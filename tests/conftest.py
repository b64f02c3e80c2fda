"""Shared fixtures: the tiny models (built once), run dirs, and real role processes; the fast
lane (FAST); and the leak check, as pyzmq's conftest has one: a test, or a module's fixtures,
that leaves a process it started running or a ZMQ socket open fails (`no_leaks`)."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.process
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

# ruff: noqa: E402
from mmlane.common import cpu_wheels

cpu_wheels.apply()  # before transformers loads: a vLLM CPU install needs it (cpu_wheels.py)
# and so do the interpreters a test starts, vLLM's own among them (ModelConfig inspects a model
# in a subprocess where its cache of models inspected is cold), as the roles' do (services/cli.py)
os.environ.update(cpu_wheels.child_env())

# isort: split
import numpy as np
import openai
import pytest
import torch
import zmq
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    Idefics3Processor,
    InternVLProcessor,
    LlavaNextProcessor,
    LlavaOnevisionProcessor,
    LlavaProcessor,
    ProcessorMixin,
    Qwen2VLProcessor,
    SmolVLMProcessor,
)
from transformers.models.pixtral import image_processing_pil_pixtral

from image_server import ImageServer
from mmlane.cli import config_from_argv
from mmlane.common.sockets import free_tcp_port as free_port  # noqa: F401  (tests import it from here)
from mmlane.engine.vision import to_device
from mmlane.launcher import Child, start_roles, stop_all
from mmlane.model import PixelNorm, Preprocessor, family_for, load_preprocessor, normalize
from mmlane.protocol.errors import FatalError

REPO = Path(__file__).resolve().parent.parent
# `free_port` is for ports that cannot be 0 (an HTTP API, `serve`'s client port); elsewhere tests
# bind port 0 and read the port back (peers.py; a frontend started with `--port 0` reports its
# port in its Ready, `Child.endpoint`), so that no other process can take it in between.
# Every test process and child shares one model cache, kept in an ignored folder of the repo.
os.environ.setdefault("MMLANE_HOME", str(REPO / ".mmlane"))
# Frontends started by tests serve no HTTP API unless a test asks for one with --http-port:
# the default port 8000 would clash between concurrent frontends and concurrent test runs.
os.environ.setdefault("MMLANE_HTTP_PORT", "0")
# The engine's device in the tests that run one (scripts/device_check runs them on CUDA). An
# engine and the in-process reference it is compared with run on the same device.
DEVICE = os.environ.get("MMLANE_TEST_DEVICE", "cpu")

FAST = (
    "test_api.py",
    "test_backend.py",
    "test_bench.py",
    "test_cache.py",
    "test_cache_property.py",
    "test_config.py",
    "test_curve.py::test_an_ipc_socket_is_made_0600_in_a_new_0700_folder",
    "test_detokenize.py",
    "test_fetch.py",
    "test_http.py::test_choices_keep_what_came_while_waiting_for_every_first_reply",
    "test_mm_pool.py::test_pipeline_histories",
    "test_mm_pool.py::test_an_image_guessed_held_but_evicted_since_is_sent_with_its_tensors",
    "test_mm_worker.py::TestMedia",
    "test_mm_worker.py::TestRender",
    "test_mm_worker.py::TestJpegDraftScale",
    "test_model.py",
    "test_ops.py::test_endpoint_label",
    "test_ops.py::test_a_free_port_is_never_given_twice",
    "test_ops.py::test_metric_names_keep_to_prometheus_characters",
    "test_ops.py::test_the_last_window_is_the_difference_of_one_runs_two_snapshots",
    "test_ops.py::test_top_shows_each_mm_workers_share_of_the_requests",
    "test_ops.py::test_a_process_that_stops_publishing_goes_stale",
    "test_ops.py::test_top_and_stats_show_the_refusals_after_the_errors",
    "test_ops.py::test_the_tools_write_a_state_with_its_restarts",
    "test_pixels.py",
    "test_protocol.py",
    "test_sampling.py",
    "test_tools.py::TestReading",
    "test_video.py",
    "test_video_render.py",
)
"""The fast lane (`scripts/test --fast`, which is `pytest -m fast`): tests of pure logic and
in-process code that start no process, neither a role nor `mmlane serve` nor a pool (`no_leaks`
fails one of them that does), a few minutes in all. Each name is a test file, or a test's node id
(or its prefix: a class, a test of every parameter) within one, as in `test_x.py::TestY`; a name
that matches no collected test is simply unused, so files may come and go."""
NOT_FAST = (
    "test_api.py::test_api_keys_guard_every_v1_route_but_not_health_or_metrics",
    "test_api.py::test_top_once_into_a_closed_pipe_ends_quietly",
    "test_api.py::test_stats_into_head_ends_quietly_with_the_status_of_a_broken_pipe",
    "test_api.py::test_top_into_head_prints_plain_views_and_ends_with_the_status_of_a_broken_pipe",
    "test_api.py::test_q_quits_the_live_view_in_a_terminal",
    "test_backend.py::test_the_engine_and_its_config_import_no_backend",
    "test_backend.py::test_a_remote_replica_that_does_not_answer_fails_each_request_retryable",
    "test_backend.py::test_a_request_whose_replica_fails_before_its_first_token_goes_to_another",
    "test_backend.py::test_the_requests_of_a_replica_that_stops_answering_go_to_another",
    "test_backend.py::test_a_replica_s_failure_is_the_request_s_one_reply",
    "test_bench.py::TestRun",
    "test_bench.py::test_throughput_run_reports_every_design",
    "test_bench.py::test_bench_video_prints_every_figure",
    "test_bench.py::test_sigterm_stops_every_process_the_bench_started",
    "test_config.py::test_serves_child_runs_with_the_config_it_was_handed",
    "test_config.py::test_image_work_runs_image_nice_below_text_work",
    "test_config.py::test_a_child_refuses_a_config_that_is_not_its_roles",
    "test_config.py::test_a_roles_config_imports_no_other_role_and_no_model",
    "test_config.py::test_a_signal_while_roles_start_leaves_no_process_running",
    "test_config.py::test_mmlane_installs_as_one_package_named_mmlane",
    "test_detokenize.py::test_a_streamed_reply_carries_the_whole_text",
    "test_fetch.py::test_https_fetch_verifies_the_certificate",
    "test_model.py::test_importing_the_model_package_patches_no_environment",
    "test_model.py::TestTinyModel::test_default_model_is_built_once",
)
"""The tests of a file in FAST that start a process (named as in FAST)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _, _, within = item.nodeid.partition("::")
        name = f"{item.path.name}::{within}" if within else item.path.name
        if _named(name, FAST) and not _named(name, NOT_FAST):
            item.add_marker(pytest.mark.fast)


def _named(test: str, names: tuple[str, ...]) -> bool:
    return any(test == name or test.startswith((f"{name}::", f"{name}[")) for name in names)


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    """A loopback HTTP server with well- and ill-behaved image routes, one per test module."""
    server = ImageServer()
    yield server
    server.close()


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor, which needs torchvision.

    ProcessorMixin pairs positional sub-processors with the attributes named in __init__'s
    signature, so the parent's `video_processor=None` argument is simply dropped.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor without its video processor, which needs torchvision. The
    settings are named in the signature, since from_pretrained passes on only those."""

    def __init__(self, image_processor=None, tokenizer=None, num_image_tokens=None,
                 vision_feature_select_strategy=None, chat_template=None, image_token="<image>",
                 video_token="<video>", vision_aspect_ratio="anyres_max_9", **kwargs):
        super().__init__(image_processor, tokenizer, None, num_image_tokens,
                         vision_feature_select_strategy, chat_template, image_token, video_token,
                         vision_aspect_ratio, **kwargs)


def _pixtral_processor() -> type:
    """PixtralProcessor, whose module imports the torchvision image processor only for a
    resize helper that the PIL one has too (`get_resize_output_image_size`): the module is
    imported with the PIL one's helper in the torchvision one's place."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    stand_in = types.ModuleType(name)
    stand_in.get_resize_output_image_size = (  # type: ignore[attr-defined]
        image_processing_pil_pixtral.get_resize_output_image_size
    )
    sys.modules.setdefault(name, stand_in)
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    return PixtralProcessor


class ImageOnlyInternVLProcessor(InternVLProcessor):
    """InternVLProcessor without its video processor, which needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length=256,
                 chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, image_seq_length, chat_template,
                         **kwargs)


def hf_processor_call(processor, prompt: str, images: list | None = None) -> dict:
    """`processor(text, images)` as the processor's own `apply_chat_template(tokenize=True)`
    calls it: without the tokenizer's special tokens when the template wrote the BOS itself."""
    bos = processor.tokenizer.bos_token
    special = {"add_special_tokens": False} if bos is not None and prompt.startswith(bos) else {}
    return dict(processor(text=[prompt], images=images or None, return_tensors="np", **special))
class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
    """SmolVLMProcessor without its video processor, which needs torchvision. Its chat template
    step is ProcessorMixin's: SmolVLM's own only adds the video processor's frame settings."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_len=169,
                 chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, image_seq_len, chat_template, **kwargs)

    apply_chat_template = ProcessorMixin.apply_chat_template


@pytest.fixture(scope="session")
def model_dirs(qwen_dir: Path, qwen2_5_dir: Path, llava_dir: Path) -> dict[str, Path]:
    """Each tiny model by the name of its builder (`mmlane tiny-model --family NAME`)."""
    return {"qwen2_vl": qwen_dir, "qwen2_5_vl": qwen2_5_dir, "llava": llava_dir,
            "llava_next": _tiny_model("llava_next"),
            "llava_onevision": _tiny_model("llava_onevision"),
            "mistral3": _tiny_model("mistral3"), "internvl": _tiny_model("internvl"),
            "idefics3": _tiny_model("idefics3"),
            "smolvlm": _tiny_model("smolvlm")}


@pytest.fixture(scope="session")
def hf_processors(model_dirs: dict[str, Path]) -> dict:
    """The in-process Hugging Face processors that mmlane's preprocessing must match exactly."""
    def qwen(model_dir: Path) -> Qwen2VLProcessor:  # Qwen2.5-VL's processor is Qwen2-VL's
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return ImageOnlyQwen2VLProcessor(
            image_processor=AutoImageProcessor.from_pretrained(model_dir, backend="pil"),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )

    return {"qwen2_vl": qwen(model_dirs["qwen2_vl"]), "qwen2_5_vl": qwen(model_dirs["qwen2_5_vl"]),
            "llava": LlavaProcessor.from_pretrained(model_dirs["llava"]),
            "llava_next": LlavaNextProcessor.from_pretrained(model_dirs["llava_next"]),
            "llava_onevision": ImageOnlyLlavaOnevisionProcessor.from_pretrained(
                model_dirs["llava_onevision"]
            ),
            "mistral3": _pixtral_processor().from_pretrained(model_dirs["mistral3"],
                                                             backend="pil"),
            "internvl": ImageOnlyInternVLProcessor.from_pretrained(model_dirs["internvl"],
                                                                   backend="pil"),
            "idefics3": Idefics3Processor.from_pretrained(model_dirs["idefics3"]),
            "smolvlm": ImageOnlySmolVLMProcessor.from_pretrained(model_dirs["smolvlm"])}


def reference_items(family: str, processor, expected, images: list) -> list[dict]:
    """The HF processor's output `expected` image by image (Family.split_items), with what it
    dropped of its image processor's output once it had expanded the prompt put back
    (InternVL's tile counts, Idefics3's rows and columns of tiles): its image processor's
    output, called with the processor's own `images_kwargs`."""
    batch = dict(expected)
    images_kwargs = getattr(processor, "images_kwargs", None)
    if images and images_kwargs:
        layout = processor.image_processor(images=images, **{**images_kwargs,
                                                             "return_tensors": "np"})
        batch.update({name: layout[name] for name in layout.keys() - batch.keys()})
    return family_for(family).split_items(processor.image_processor, batch)


def as_processor_output(tensors: dict[str, np.ndarray], norm: PixelNorm) -> dict[str, np.ndarray]:
    """An item's tensors as the HF processor returns them: its uint8 pixels normalised the way
    the engine does it (services/model/pixels.py), on the engine's DEVICE."""
    assert tensors["pixel_values"].dtype == np.uint8, tensors["pixel_values"].dtype
    pixels = normalize(to_device(tensors["pixel_values"], torch.device(DEVICE)), norm)
    return {**tensors, "pixel_values": pixels.cpu().numpy()}


@pytest.fixture(scope="session")
def preprocessors(model_dirs: dict[str, Path]) -> dict[str, Preprocessor]:
    """mmlane's preprocessor of each tiny family, loaded once."""
    return {family: load_preprocessor(path) for family, path in model_dirs.items()}


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[openai.OpenAI]:
    """The openai client of the module's `server` (test_http.py's `Server`: `mmlane serve`
    over HTTP)."""
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def prep(qwen_dir: Path) -> Preprocessor:
    """The tiny Qwen2-VL's tokenizer, chat template and image processor, loaded once."""
    return load_preprocessor(qwen_dir)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the embedded default model (a child process, once per MMLANE_HOME) before any
    test: otherwise the first test to need it would count the builder as a process it started,
    and a fast-lane test would fail for it on a fresh clone."""
    from mmlane.model import ensure_default_model

    ensure_default_model()


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    from mmlane.model import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def llava_dir() -> Path:
    return _tiny_model("llava")


@pytest.fixture(scope="session")
def qwen2_5_dir() -> Path:
    return _tiny_model("qwen2_5_vl")


def _tiny_model(family: str) -> Path:
    """The tiny model of `family`, built once beside the default one."""
    from mmlane.model import default_model_dir
    from mmlane.model.tiny import build_tiny_model

    target = default_model_dir().parent / f"tiny-{family.replace('_', '-')}"
    if not (target / "config.json").exists():
        build_tiny_model(target, family=family)
    return target


def start_role(
    role: str, args: list[str], run_dir: Path, timeout_s: float = 180, log_dir: Path | None = None
) -> Child:
    """Start `mmlane ROLE ARGS` as a real process and wait for its ready handshake.

    With `log_dir`, the role logs to LOG_DIR/ROLE.log (see `role_log`), quoted if it fails to start.
    """
    try:
        config = config_from_argv(role, args, run_dir)
        (child,) = start_roles({role: config}, run_dir, timeout_s, log_dir=log_dir)
    except FatalError as exc:
        if log_dir is None:
            raise
        pytest.fail(f"{exc}\n{(log_dir / f'{role}.log').read_text(errors='replace')}")
    return child


ROLES = ("engine", "mm-worker", "frontend")


def make_keys(folder: Path, *roles: str) -> None:
    """`mmlane keys --out FOLDER --name ROLE` for each role."""
    for role in roles:
        subprocess.run([sys.executable, "-m", "mmlane.cli", "keys", "--out", str(folder),
                        "--name", role], cwd=REPO, check=True, capture_output=True)


def keys_folder(pairs: Path, role: str, into: Path, own: Path | None = None) -> Path:
    """A role's --curve-keys folder as deploy/ hands it out: its own pair (from `own`, else
    `pairs`) and every role's public key from `pairs`."""
    into.mkdir(mode=0o700)
    for name in ROLES:
        shutil.copy(pairs / f"{name}.key", into)
    shutil.copy((own or pairs) / f"{role}.key_secret", into)
    shutil.copy((own or pairs) / f"{role}.key", into)
    return into


FAILED = pytest.StashKey[bool]()
"""Set on a test whose setup, call or teardown failed (for fixtures that tell more then)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.failed:
        item.stash[FAILED] = True
    return report


class Process(NamedTuple):
    pid: int
    parent: int
    session: int
    cmdline: bytes
    group: int
    state: str
    """'Z' for a zombie: it has ended, and its parent has not reaped it yet."""
    started: int
    """When it started, in clock ticks since boot: with the pid, names the process for good."""


def processes() -> Iterator[Process]:
    """Every process of the machine, as /proc lists it now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # it has just ended
            continue
        # After the command's name, in parentheses (proc(5) counts from 1): 3 state, 4 parent,
        # 5 process group, 6 session, 22 start time.
        fields = stat.rsplit(")", 1)[1].split()
        yield Process(int(entry.name), int(fields[1]), int(fields[3]), cmdline,
                      int(fields[2]), fields[0], int(fields[19]))


def running() -> Iterator[Process]:
    """The processes that have not ended: a zombie has (it holds no more than its pid until
    its parent reaps it, or init once it is orphaned, which may take a while in a container)."""
    return (process for process in processes() if process.state != "Z")


# --- Leaks: a test fails if it leaves a process it started running or a ZMQ socket open -------

OWNER_ENV = "MMLANE_TEST_OWNER"
"""Every process this pytest starts inherits it, so the leak check finds one whose parent has
died (an orphan no longer descends from pytest); another pytest beside this one sets its own."""
os.environ[OWNER_ENV] = str(os.getpid())
SESSION_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")
"""Processes that multiprocessing starts once and keeps for the whole run, by design."""
HELD_DEPTH, HELD_BREADTH = 5, 100_000
"""How many references deep a fixture's object may hold a socket it made or a process it started
during a test, and how many objects at each depth are looked at (a model's fixture holds many)."""
LEAK_GRACE_S = 5.0
"""How long a leak may take to go away after the test (a role that is still exiting, a thread
that closes its socket) before it counts."""

PYZMQ_GARBAGE_COLLECTOR = os.path.join("zmq", "utils", "garbage.py")

_open_sockets: weakref.WeakKeyDictionary[zmq.Socket, str] = weakref.WeakKeyDictionary()
"""Every ZMQ socket made in this process and not yet collected, with where it was made."""
_reported_sockets: weakref.WeakSet[zmq.Socket] = weakref.WeakSet()
"""Leaked sockets already reported: they are not closed (a thread may still use one), and are
not reported again."""
_started: list[str] = []
"""The processes the current test and the fixtures set up for it started (subprocess and fork),
as the audit hook saw them."""


def _note_socket(add_socket):
    def add_and_note(context: zmq.Context, socket: zmq.Socket) -> None:
        add_socket(context, socket)
        if (where := _made_at(sys._getframe(1))) is not None:
            _open_sockets[socket] = where
    return add_and_note


zmq.Context._add_socket = _note_socket(zmq.Context._add_socket)  # every Context.socket() calls it


def _made_at(frame: types.FrameType | None) -> str | None:
    """The first few frames of this repository's code that made a socket; None for one that
    pyzmq's zero-copy garbage collector makes for itself (it lives as long as the process)."""
    where: list[str] = []
    while frame is not None and len(where) < 3:
        path = frame.f_code.co_filename
        if path.endswith(PYZMQ_GARBAGE_COLLECTOR):
            return None
        if path.startswith(str(REPO)) and not path.endswith("conftest.py"):
            where.append(f"{Path(path).relative_to(REPO)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(where) or "outside the repository"


def _note_process_starts(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and args[1] != ["uname", "-p"]:  # platform.processor(), once
        _started.append(" ".join(map(str, args[1])) if isinstance(args[1], list) else str(args[1]))
    elif event in ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"):
        _started.append(event)


sys.addaudithook(_note_process_starts)


def _note_pool_starts(start):
    def start_and_note(process: multiprocessing.process.BaseProcess) -> None:
        _started.append(f"multiprocessing: {process.name}")  # spawn raises no audit event
        start(process)
    return start_and_note


multiprocessing.process.BaseProcess.start = _note_pool_starts(  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start)


class Snapshot(NamedTuple):
    """What this test run holds at one moment: its live processes and open sockets."""

    processes: dict[tuple[int, int], Process]
    sockets: weakref.WeakSet[zmq.Socket]

    @classmethod
    def now(cls) -> Snapshot:
        return cls({(p.pid, p.started): p for p in _own_processes()},
                   weakref.WeakSet(_sockets_open()))

    def leaked_processes(self) -> list[Process]:
        """Processes started since, and still running, that descend from no process older than
        the snapshot but pytest itself (a role that `mmlane serve` restarted is serve's, and so
        are the processes that role starts, vLLM's engine core; serve is its fixture's)."""
        older = {pid for pid, _ in self.processes}
        live = _own_processes()
        parents = {p.pid: p.parent for p in live}

        def from_older(p: Process) -> bool:
            parent = p.parent
            while parent in parents and parent not in older:
                parent = parents[parent]
            return parent in older

        return [p for p in live if (p.pid, p.started) not in self.processes and not from_older(p)]

    def leaked_sockets(self) -> list[zmq.Socket]:
        return [socket for socket in _sockets_open()
                if socket not in self.sockets and socket not in _reported_sockets]


def _own_processes() -> list[Process]:
    """This run's live processes: pytest's descendants and any that carry its OWNER_ENV."""
    me, mark = os.getpid(), f"{OWNER_ENV}={os.getpid()}".encode()
    every = {p.pid: p for p in processes()}

    def ours(p: Process) -> bool:
        ancestor = p
        while ancestor.parent in every and ancestor.pid != me:
            ancestor = every[ancestor.parent]
        if ancestor.pid == me:
            return True
        try:
            return mark in Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    return [p for p in every.values() if p.pid != me and p.state != "Z"
            and not any(helper in p.cmdline for helper in SESSION_HELPERS) and ours(p)]


def _sockets_open() -> list[zmq.Socket]:
    while True:
        try:
            return [socket for socket in list(_open_sockets) if not socket.closed]
        except RuntimeError:  # another thread made a socket meanwhile: look again
            continue


def _leaks(before: Snapshot, owners: tuple[object, ...]) -> tuple[list[Process], list[zmq.Socket]]:
    """What was leaked since `before`, once LEAK_GRACE_S has passed for it to go away; what the
    `owners` hold is theirs, not leaked."""
    deadline = time.monotonic() + LEAK_GRACE_S
    owned_sockets, owned_pids = weakref.WeakSet[zmq.Socket](), set[int]()
    while True:
        processes_left = [p for p in before.leaked_processes() if p.pid not in owned_pids]
        sockets_left = [socket for socket in before.leaked_sockets() if socket not in owned_sockets]
        if (processes_left or sockets_left) and owners:
            held_sockets, held_pids = _held_by(owners, sockets_left, processes_left)
            owned_sockets.update(socket for socket in sockets_left if id(socket) in held_sockets)
            owned_pids |= held_pids
            processes_left = [p for p in processes_left if p.pid not in owned_pids]
            sockets_left = [socket for socket in sockets_left if socket not in owned_sockets]
        if not processes_left and not sockets_left or time.monotonic() > deadline:
            return processes_left, sockets_left
        if sockets_left:
            gc.collect()  # a socket in a reference cycle is closed when it is collected
        time.sleep(0.1)


def _end(leaked: list[Process]) -> None:
    """SIGKILL each leaked process and its process group (a role runs in a session of its
    own), so that the next test starts clean."""
    for p in leaked:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if p.group == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            os.kill(p.pid, signal.SIGKILL)


def _command(p: Process) -> str:
    return p.cmdline.replace(b"\0", b" ").decode(errors="replace").strip()


def _held_by(owners: tuple[object, ...], sockets: list[zmq.Socket],
             processes: list[Process]) -> tuple[set[int], set[int]]:
    """The ids of those of `sockets`, and the pids of those of `processes` (by their Popen), that
    the `owners` hold, a few references deep: a module's fixture whose object makes a socket or
    starts a process during a test (a role started again in place of one the test killed), and
    closes or stops it at the module's end."""
    wanted, pids = {id(socket) for socket in sockets}, {p.pid for p in processes}
    held_sockets: set[int] = set()
    held_pids: set[int] = set()
    seen: set[int] = set()
    level = list(owners)
    for _ in range(HELD_DEPTH):
        deeper = []
        for thing in level[:HELD_BREADTH]:
            if id(thing) in seen or isinstance(thing, type | types.ModuleType | types.FunctionType):
                continue
            seen.add(id(thing))
            if id(thing) in wanted:
                held_sockets.add(id(thing))
            elif isinstance(thing, subprocess.Popen) and thing.pid in pids:
                held_pids.add(thing.pid)
            else:
                deeper.extend(gc.get_referents(thing))
        level = deeper
    return held_sockets, held_pids


def _leak_report(before: Snapshot, what: str, owners: tuple[object, ...] = ()) -> list[str]:
    """Lines that name what was leaked since `before` (none if nothing was), once it is ended."""
    processes_left, sockets_left = _leaks(before, owners)
    _end(processes_left)
    _reported_sockets.update(sockets_left)
    if not processes_left and not sockets_left:
        return []
    lines = [f"{what} left {len(processes_left)} process(es) running and "
             f"{len(sockets_left)} ZMQ socket(s) open:"]
    lines += [f"  process {p.pid}: {_command(p)}" for p in processes_left]
    lines += [f"  socket {zmq.SocketType(socket.type).name} made at {_open_sockets.get(socket)}"
              for socket in sockets_left]
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started.clear()  # before any fixture of the test: those it uses count as its own (FAST)


@pytest.fixture(autouse=True, scope="module")
def no_leaks_by_module_fixtures(request: pytest.FixtureRequest) -> Iterator[None]:
    """The module's fixtures (set up after this one, so torn down before) leave nothing."""
    before = Snapshot.now()
    yield
    if report := _leak_report(before, f"{request.module.__name__}'s fixtures"):
        pytest.fail("\n".join(report), pytrace=False)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """The test leaves no process it started running and no socket it made open; what its
    fixtures hold (started or made before the test, or held by their objects) is theirs, checked
    when the module ends. A test in the fast lane starts no process at all. A test that failed
    anyway is not failed again for its leaks, but they are ended all the same."""
    before = Snapshot.now()
    yield
    fixtures = tuple(getattr(request.node, "funcargs", {}).values())
    report = _leak_report(before, "the test", fixtures)
    if _started and request.node.get_closest_marker("fast") is not None:
        report.append(f"a test of the fast lane (FAST) started processes: {_started[:3]}; take "
                      f"it out of FAST, or name it in NOT_FAST")
    if report and not request.node.stash.get(FAILED, False):
        pytest.fail("\n".join(report), pytrace=False)


def pool_pids(worker_pid: int) -> list[int]:
    """An MM worker's pool processes: its children that run multiprocessing's spawn_main."""
    return sorted(process.pid for process in processes()
                  if process.parent == worker_pid and b"spawn_main" in process.cmdline)


def role_log(child: Child) -> str:
    """What a role started with a `log_dir` has logged so far."""
    assert child.log_path is not None, f"{child.role} was started without a log_dir"
    return child.log_path.read_text(errors="replace")


def stop_role(child: Child) -> int:
    stop_all([child])
    return child.process.returncode


def _short_tmp_dir() -> Iterator[Path]:
    # ipc:// paths must stay short (about 100 bytes), so not under pytest's long tmp paths.
    path = Path(tempfile.mkdtemp(prefix="mml-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


run_dir = pytest.fixture(_short_tmp_dir, name="run_dir")
module_run_dir = pytest.fixture(_short_tmp_dir, name="module_run_dir", scope="module")
