"""The canonical tensor index and its geometry."""
from .types import (Box, CheckpointIndex, FlatRange, IntegrityCheck, Location, ObjectEntry, Piece,
                    Region, TensorEntry)

__all__ = ["Box", "CheckpointIndex", "FlatRange", "IntegrityCheck", "Location", "ObjectEntry",
           "Piece", "Region", "TensorEntry"]
