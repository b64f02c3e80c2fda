"""Run at interpreter startup by the processes that services/common/cpu_wheels.py's `child_env`
starts (this folder first on their PYTHONPATH): apply its fixes before anything imports vLLM,
then run the sitecustomize this one hides, if there is one."""

import importlib
import sys
from pathlib import Path

from mmlane.common.cpu_wheels import apply

apply()

_here = str(Path(__file__).parent)
sys.path[:] = [p for p in sys.path if p != _here]
_this = sys.modules.pop("sitecustomize")
try:
    importlib.import_module("sitecustomize")
except ImportError:
    sys.modules["sitecustomize"] = _this
