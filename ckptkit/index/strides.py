"""Row-major strides and strided spans: arithmetic on shapes, with no index types.

Kept apart from geometry (which works on Box and FlatRange) so that the stand-ins of torch's
small types (ckptkit.torch_types), which sit below the index, can use it.
"""

from __future__ import annotations


def row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def strided_span(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from the first to the last element of a strided view (0 when it is empty)."""
    if any(n == 0 for n in sizes):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(sizes, strides))
