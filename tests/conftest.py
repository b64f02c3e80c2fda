"""Shared fixtures: the tiny models (built once), run dirs, and real role processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

# ruff: noqa: E402
from services.common import cpu_wheels

cpu_wheels.apply()  # before transformers loads: a vLLM CPU install needs it (cpu_wheels.py)

# isort: split
import numpy as np
import pytest
import torch
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
from protocol.errors import FatalError
from services.cli import config_from_argv
from services.common.sockets import free_tcp_port as free_port  # noqa: F401  (tests import it from here)
from services.engine.hf.adapters import to_device
from services.launcher import Child, start_roles, stop_all
from services.model import PixelNorm, Preprocessor, family_for, load_preprocessor, normalize

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


@pytest.fixture(scope="session")
def prep(qwen_dir: Path) -> Preprocessor:
    """The tiny Qwen2-VL's tokenizer, chat template and image processor, loaded once."""
    return load_preprocessor(qwen_dir)


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    from services.model import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def llava_dir() -> Path:
    return _tiny_model("llava")


@pytest.fixture(scope="session")
def qwen2_5_dir() -> Path:
    return _tiny_model("qwen2_5_vl")


def _tiny_model(family: str) -> Path:
    """The tiny model of `family`, built once beside the default one."""
    from services.model import build_tiny_model, default_model_dir

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
        subprocess.run([sys.executable, "-m", "services.cli", "keys", "--out", str(folder),
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
        # After the command's name, in parentheses: state, parent, process group, session.
        fields = stat.rsplit(")", 1)[1].split()
        yield Process(int(entry.name), int(fields[1]), int(fields[3]), cmdline)


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
