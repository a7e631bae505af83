"""The model runner: executes one scheduler plan on the model and its caches."""

from hybridserve.runner.model_runner import ModelRunner, StepLogits

__all__ = ["ModelRunner", "StepLogits"]
