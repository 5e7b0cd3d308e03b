"""Training-loop hooks."""
from .checkpointer import Checkpointer

__all__ = ["Checkpointer"]
