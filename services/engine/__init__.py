"""The engine role: runs the model on rendered requests and streams their tokens back.

Importing it loads no backend (no torch): the runner is built by the factory that the `backend`
setting names (runner.py), when the engine starts.
"""

from mmlane.engine.config import EngineConfig
from mmlane.engine.engine import Engine
from mmlane.engine.runner import ModelRunner, ModelSpec, StepOutput

__all__ = ["Engine", "EngineConfig", "ModelRunner", "ModelSpec", "StepOutput"]
