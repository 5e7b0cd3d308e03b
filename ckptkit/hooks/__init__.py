"""Training-loop hooks."""
from .checkpointer import Checkpointer, SkippedStepsWarning
from .steps import DuplicateStepError

__all__ = ["Checkpointer", "SkippedStepsWarning", "DuplicateStepError"]
