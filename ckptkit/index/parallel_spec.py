"""What `reshard --to` (and `--from`) may name: a data-parallel world size, a device mesh, or
DeepSpeed's model-parallel sizes.

    16                                  a world size: FSDP2 Shard(0) / ZeRO at 16 ranks (as always)
    mesh=dp_shard:4,tp:2                a torch DeviceMesh, dims in init_device_mesh's order
    mesh=dp_replicate:2,dp_shard:2      HSDP (replicate x shard)
    tp=2,pp=2,dp=4   ep=4,dp=8          DeepSpeed's parallel sizes

The text is parsed once, here, into a typed value, so operations and writers never look at strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")  # torchtitan's names, in its mesh order
PARALLEL_SIZES = ("tp", "pp", "ep", "dp")
# The most ranks a target may have: each rank is one or more files, and a layout is computed per
# rank, so a typo such as --to 1000000000 would otherwise run for hours writing empty files. The
# largest jobs run on about 10^5 accelerators.
MAX_RANKS = 1 << 20
_NAME_SIZE = re.compile(r"^([a-z_]+)\s*[:=]\s*(\d+)$")


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh: (name, size) per dimension, in init_device_mesh's order (ranks are
    row-major over it: the last dimension varies fastest)."""

    dims: tuple[tuple[str, int], ...]

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.dims:
            n *= size
        return n

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    def size(self, name: str) -> int:
        """The size of dimension `name` (1 when the mesh has no such dimension)."""
        return dict(self.dims).get(name, 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Each dimension's index of global rank `rank`."""
        coords: dict[str, int] = {}
        for name, size in reversed(self.dims):
            coords[name] = rank % size
            rank //= size
        return coords

    def __str__(self) -> str:
        return "mesh=" + ",".join(f"{name}:{size}" for name, size in self.dims)


@dataclass(frozen=True)
class ParallelSizes:
    """DeepSpeed's parallel sizes (tp, pp, ep, dp); 1 for a size not given."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in PARALLEL_SIZES if getattr(self, n) != 1) or "dp=1"


ParallelTarget = int | MeshSpec | ParallelSizes


def parse_parallel(text: str | int, option: str = "--to") -> ParallelTarget:
    """`text` as an int (a world size), a MeshSpec or ParallelSizes; a UsageError naming `option`
    and what was expected otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return _world(text, option)
    text = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return _world(int(text), option)
    if text.startswith("mesh="):
        return _checked(_mesh(text[len("mesh=") :], option), option)
    return _checked(_sizes(text, option), option)


def check_ranks(n: int, option: str) -> int:
    """`n` ranks, refused in one sentence beyond MAX_RANKS."""
    if n > MAX_RANKS:
        raise UsageError(
            f"{option} asks for {n} ranks; ckptkit writes checkpoints for at most {MAX_RANKS} ranks "
            f"(one or more files each)"
        )
    return n


# A DCP layout on a device mesh keeps per-rank boxes and owners for every item: measured on the
# 4-rank mesh fixture (68 items), 131,072 ranks took 188 s and 1.6 GB (1-D FSDP2: 108 s, 0.4 GB), so
# 2^20 ranks would run ~25 min in ~12 GB. Beyond this many ranks a mesh is refused in one sentence.
MAX_MESH_RANKS = 1 << 16


def check_mesh_ranks(mesh: "MeshSpec", option: str) -> "MeshSpec":
    """A target mesh of at most MAX_MESH_RANKS ranks (refused before anything is read or written)."""
    if mesh.world_size > MAX_MESH_RANKS:
        raise UsageError(
            f"{option} {mesh} asks for {mesh.world_size} ranks; ckptkit lays out a device mesh of "
            f"at most {MAX_MESH_RANKS} ranks (its layout time and memory grow with the ranks)"
        )
    return mesh


# The DeepSpeed writers keep each rank's structures until its files are written: measured on the
# 4-rank TP fixture, tp=1,dp=16384 took 45 s and 440 MB (2^20 ranks: ~50 min, ~28 GB).
MAX_DEEPSPEED_RANKS = 1 << 16


def check_deepspeed_ranks(n: int, option: str) -> int:
    """A DeepSpeed target of at most MAX_DEEPSPEED_RANKS ranks (refused before anything is written)."""
    if n > MAX_DEEPSPEED_RANKS:
        raise UsageError(
            f"{option} asks for {n} ranks; ckptkit writes DeepSpeed checkpoints for at most "
            f"{MAX_DEEPSPEED_RANKS} ranks (its time and memory grow with the ranks)"
        )
    return n


def _checked(target: "MeshSpec | ParallelSizes", option: str) -> "MeshSpec | ParallelSizes":
    check_ranks(target.world_size, f"{option} {target}")
    return target


def _world(n: int, option: str) -> int:
    if n < 1:
        raise UsageError(f"{option} must be at least 1 (got {n})")
    return check_ranks(n, f"{option} {n}")


def _pairs(body: str, option: str, form: str) -> list[tuple[str, int]]:
    pairs = []
    for part in body.split(","):
        m = _NAME_SIZE.match(part.strip())
        if not m:
            raise UsageError(
                f"{option}: {part.strip()!r} is not name{form}size (expected e.g. {option} "
                f"mesh=dp_shard:4,tp:2, {option} tp=2,dp=4 or {option} 16)"
            )
        pairs.append((m.group(1), int(m.group(2))))
    names = [n for n, _ in pairs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise UsageError(f"{option}: {dup} is given twice")
    zero = next((n for n, s in pairs if s < 1), None)
    if zero:
        raise UsageError(f"{option}: the size of {zero} must be at least 1")
    return pairs


def _mesh(body: str, option: str) -> MeshSpec:
    pairs = _pairs(body, option, ":")
    unknown = [n for n, _ in pairs if n not in MESH_DIMS]
    if unknown:
        raise UsageError(f"{option}: mesh dimension {unknown[0]!r} is not one of {', '.join(MESH_DIMS)}")
    if not any(n.startswith("dp_") for n, _ in pairs):
        raise UsageError(
            f"{option}: a mesh needs dp_shard or dp_replicate (FSDP2 shards on the data-parallel "
            f"dimensions), e.g. mesh=dp_shard:4,tp:2"
        )
    return MeshSpec(tuple(pairs))


def _sizes(body: str, option: str) -> ParallelSizes:
    pairs = _pairs(body, option, "=")
    unknown = [n for n, _ in pairs if n not in PARALLEL_SIZES]
    if unknown:
        raise UsageError(
            f"{option}: {unknown[0]!r} is not one of {', '.join(PARALLEL_SIZES)} (or give a world "
            f"size, or mesh=dim:size,...)"
        )
    return ParallelSizes(**dict(pairs))
