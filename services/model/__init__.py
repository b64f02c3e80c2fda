"""The model package every role uses: loading a model directory, the per-family placeholder
description, image preprocessing, and the offline tiny-model builder.

Importing it imports transformers' image processors, which import torchvision where it is
installed: in a vLLM CPU install, whose torchvision fails beside CPU torch, a process applies
services/common/cpu_wheels.py first (each role's entry point in services/cli.py does)."""

from mmlane.common.model_dir import (
    ModelDirError,
    default_model_dir,
    ensure_default_model,
    resolve_model_dir,
)
from mmlane.model.families import FAMILIES, Family, UnsupportedModelError, family_for
from mmlane.model.loading import (
    ImageError,
    ImageItem,
    Preprocessor,
    PromptError,
    load_model,
    load_preprocessor,
)
from mmlane.model.pixels import PixelNorm, model_layout, normalize

__all__ = [
    "FAMILIES",
    "Family",
    "ImageError",
    "ImageItem",
    "ModelDirError",
    "PixelNorm",
    "Preprocessor",
    "PromptError",
    "UnsupportedModelError",
    "default_model_dir",
    "ensure_default_model",
    "family_for",
    "load_model",
    "load_preprocessor",
    "model_layout",
    "normalize",
    "resolve_model_dir",
]
