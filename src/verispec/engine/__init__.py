from .engine import Engine, StepResult
from .request import Request

__all__ = ["Engine", "Request", "StepResult"]
