"""Where a model directory is: the user's, checked, or the embedded default's, built once.

Import-light (no transformers, no torch): `mmlane serve` resolves the model here and holds
neither; the default model is built by a child process (`mmlane tiny-model`)."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-qwen2-vl"
BUILDER_VERSION = 7
"""services/model/tiny.py's version: bump it whenever the files it builds change. It is part of
the default model's path, so a changed builder never reuses a stale build."""


class ModelDirError(ValueError):
    """The model directory is missing, incomplete or unusable."""


def default_model_dir() -> Path:
    home = Path(os.environ.get("MMLANE_HOME", Path.home() / ".cache" / "mmlane"))
    return home / f"builder-v{BUILDER_VERSION}" / DEFAULT_MODEL_NAME


def resolve_model_dir(model: str | Path | None) -> Path:
    """The directory to load: the embedded default when `model` is None, else `model` checked."""
    if model is None:
        return ensure_default_model()
    model_dir = Path(model).expanduser()
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(
            f"{model_dir} has no config.json; expected a Hugging Face model directory"
        )
    return model_dir


def ensure_default_model() -> Path:
    """Build the embedded default model once; later calls (and concurrent starts) reuse it."""
    target = default_model_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: readers never see a half-written directory, and when
    # two processes race, the loser's rename fails and it uses the winner's identical build.
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        built = subprocess.run(
            [sys.executable, "-m", "mmlane.cli", "tiny-model", "--out", str(staging)],
            capture_output=True, text=True, check=False,
        )
        if built.returncode != 0:
            raise ModelDirError(f"building the embedded model in {staging} failed "
                                f"(exit {built.returncode}): {built.stderr.strip()[-2000:]}")
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
