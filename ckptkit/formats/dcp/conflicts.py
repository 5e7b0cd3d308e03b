"""Records of a DCP checkpoint that conflict: refused, never resolved by picking one.

torch looks a storage record up by MetadataIndex's fqn and offset only (`index` is a hint it
leaves out of __eq__ and __hash__), so two records of one chunk that differ in the hint collapse
to one when torch unpickles the .metadata; and rank-local metadata files describe each key their
rank saved, alike on every rank. Either conflict leaves no one right reading.
"""

from __future__ import annotations

from typing import Any

from ...errors import FormatError, name_of


def refuse_twin(label: str, fqn: Any, where: tuple[int, ...] | None) -> None:
    """Two storage records of one chunk (or value) in one .metadata."""
    chunk = (
        f"the chunk at offsets {list(where)} of tensor {name_of(fqn)}" if where is not None else f"value {name_of(fqn)}"
    )
    raise FormatError(
        f"{label}: storage_data holds two records for {chunk}; torch looks a record up by name and "
        f"offsets only (not the index hint) and keeps one of them, so ckptkit refuses to pick"
    )


def same_entry(first: tuple, other: tuple, key: str, label: str) -> None:
    """A key two rank-local metadata files both describe must be one tensor of one dtype and
    shape (or a value in both): `first` and `other` are what each file says of it."""
    if first != other:
        raise FormatError(
            f"{label}: state_dict_metadata describes {name_of(key)} otherwise than an earlier "
            f"rank's metadata file does (dtype, shape or kind); refusing to pick one"
        )
