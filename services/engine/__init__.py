"""The engine role: runs the model on rendered requests and streams their tokens back."""

from services.engine.engine import Engine
from services.engine.hf_runner import HFRunner
from services.engine.runner import ModelRunner, ModelSpec, StepOutput

__all__ = ["Engine", "HFRunner", "ModelRunner", "ModelSpec", "StepOutput"]
