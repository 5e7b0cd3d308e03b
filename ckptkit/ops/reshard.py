"""`ckptkit reshard`: the same format, laid out for a new world size.

Any registered format whose capabilities say it `reshards` (formats/registry.py) writes itself:
DCP: FSDP2's layout at M ranks (torch.chunk on dim 0 for the tensors the source sharded;
replicated tensors stay whole, written once), one data file per rank, values copied verbatim.
DeepSpeed: a native ZeRO checkpoint for M data-parallel ranks (formats/deepspeed/writer.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..errors import UnsupportedError, UsageError
from ..index.parallel_spec import MeshSpec, ParallelSizes, check_deepspeed_ranks, check_mesh_ranks, parse_parallel
from ..formats.protocols import TO_MESH, TO_PARALLEL_SIZES, ZERO_PARTITIONS
from ..formats.registry import capabilities_of, format_of, open_checkpoint
from ..runner.heap import frozen_heap
from ..runner.readahead import ReadAhead
from ..storage.output import open_output
from ..context import RunContext, context_of


@dataclass
class ReshardResult:
    out: str
    format: str
    from_world_size: int | None
    to_world_size: int
    files: list[str]
    tensors: int
    bytes: int
    notes: list[str] = field(default_factory=list)  # lines the summary adds (an HF Trainer folder's)


def reshard(
    src: str,
    out: str,
    to: "int | str | MeshSpec | ParallelSizes",
    expect_from: "int | str | MeshSpec | None" = None,
    options: RunContext | None = None,
    tag: str | None = None,
    *,
    ctx: RunContext | None = None,
    tp_rules: str | None = None,
    model_only: bool = False,
) -> ReshardResult:
    """`to`: a world size, or (parsed by index/parallel_spec.py) a device mesh `mesh=dp_shard:4,tp:2`
    or DeepSpeed's sizes `tp=2,pp=2,dp=4`. `ctx`: the run's context (`options=` is its older name).
    `tp_rules`: the split rules file for a mesh with tp, or DeepSpeed sizes with tp, over a source
    saved without tp (None: the command line's --tp-rules, then, for a mesh, the built-in rules).
    `model_only`: leave the optimizer out (parallel sizes, for a format whose capabilities say it can)."""
    ctx = context_of(ctx, options)
    to = parse_parallel(to, "--to") if not isinstance(to, (MeshSpec, ParallelSizes)) else to
    if expect_from is not None and not isinstance(expect_from, MeshSpec):
        expect_from = parse_parallel(expect_from, "--from")
        if isinstance(expect_from, ParallelSizes):
            raise UnsupportedError(f"--from {expect_from}: model-parallel sizes are not supported yet for reshard")
    opened = open_checkpoint(src, tag=tag, follow_links=ctx.follow_links)
    index = opened.index
    if capabilities_of(index).writes(ZERO_PARTITIONS) and isinstance(to, (int, ParallelSizes)):
        check_deepspeed_ranks(to if isinstance(to, int) else to.world_size, f"--to {to}")
    if isinstance(to, ParallelSizes):
        return _reshard_parallel(opened, src, out, to, expect_from, ctx, tp_rules, model_only)
    if model_only:
        raise UsageError("--model-only goes with parallel sizes, --to tp=T,pp=P[,dp=D]")
    if isinstance(to, MeshSpec):
        return _reshard_mesh(opened, src, out, to, expect_from, ctx, tp_rules)
    if isinstance(expect_from, MeshSpec):
        if index.world_size != expect_from.world_size:
            raise UsageError(
                f"{src}: was saved at world size {index.world_size}, not {expect_from.world_size} "
                f"(--from {expect_from})"
            )
        expect_from = None
    if opened.trainer is not None:  # checkpoint-N/ as a unit: parts resharded, side files copied
        from .trainer_folder import reshard_folder, source_world

        if expect_from is not None and source_world(opened) != expect_from:
            raise UsageError(f"{src}: was saved at world size {source_world(opened)}, not {expect_from} (--from)")
        res = reshard_folder(opened, out, to, ctx, src)
        return ReshardResult(out, index.format, res.from_world_size, to, res.files, res.tensors, res.bytes, res.notes())
    if expect_from is not None and index.world_size != expect_from:
        raise UsageError(f"{src}: was saved at world size {index.world_size}, not {expect_from} (--from)")
    from .lightning_folder import is_folder, write_folder

    if is_folder(opened):  # Lightning's FSDP folder as a unit: its DCP part resharded, meta.pt copied
        res = write_folder(opened, out, to, ctx, src)
        return ReshardResult(out, index.format, res.from_world_size, to, res.files, res.tensors, res.bytes, res.notes())
    fmt = format_of(index)
    if not fmt.capabilities.reshards:
        raise UnsupportedError(
            f"{src}: a {index.format} checkpoint is not sharded by world size, so there "
            f"is nothing to reshard (reshard takes a DCP folder or a DeepSpeed checkpoint)"
        )
    ctx.progress.start(index.total_tensor_bytes, f"reshard {index.world_size}->{to}")
    with (
        frozen_heap(),
        open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=(src,)) as target,
        ReadAhead(opened.source, index, ctx, target) as run_ctx,
    ):  # the disk works on while workers copy
        files = fmt.reshard(opened, target, to, run_ctx)
    ctx.progress.close()
    return ReshardResult(out, index.format, index.world_size, to, files, len(index.tensors), index.total_tensor_bytes)


def _reshard_parallel(
    opened,
    src: str,
    out: str,
    sizes: ParallelSizes,
    expect_from: "int | MeshSpec | None",
    ctx: RunContext,
    tp_rules: str | None = None,
    model_only: bool = False,
) -> ReshardResult:
    """DeepSpeed's parallel sizes (`tp=2,dp=4`, `ep=4,dp=8`): the format's `reshard_parallel`
    picks the writer of the source's kind (mixture of experts, tensor parallel)."""
    index = opened.index
    fmt = _writer_with(
        opened,
        TO_PARALLEL_SIZES,
        f"--to {sizes}: model-parallel sizes are not supported yet for "
        "{what} (reshard takes a world size, or mesh=... for DCP)",
    )
    if expect_from is not None and not isinstance(expect_from, MeshSpec) and index.world_size != expect_from:
        raise UsageError(f"{src}: was saved at world size {index.world_size}, not {expect_from} (--from)")
    if model_only and not fmt.capabilities.model_only_reshard:
        raise UsageError(f"--model-only: a {index.format} checkpoint is resharded whole")
    extra = {"model_only": True} if model_only else {}
    ctx.progress.start(index.total_tensor_bytes, f"reshard {index.world_size}->{sizes}")
    with (
        rules_file(tp_rules),
        frozen_heap(),
        open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=(src,)) as target,
    ):
        files = fmt.reshard_parallel(opened, target, sizes, ctx, **extra)
    ctx.progress.close()
    files, notes = files if isinstance(files, tuple) else (files, [])
    return ReshardResult(
        out,
        index.format,
        index.world_size,
        sizes.world_size,
        files,
        len(index.tensors),
        index.total_tensor_bytes,
        [f"target {sizes}", *notes],
    )


def _reshard_mesh(
    opened,
    src: str,
    out: str,
    mesh: MeshSpec,
    expect_from: "int | MeshSpec | None",
    ctx: RunContext,
    tp_rules: str | None,
) -> ReshardResult:
    """DCP on a device mesh, as torch's dcp.save writes it (formats' `reshard_mesh`)."""
    index = opened.index
    fmt = _writer_with(
        opened,
        TO_MESH,
        f"--to {mesh}: not supported yet for {{what}} (a device mesh is written for a DCP folder)",
    )
    if isinstance(expect_from, int) and index.world_size != expect_from:
        raise UsageError(f"{src}: was saved at world size {index.world_size}, not {expect_from} (--from)")
    check_mesh_ranks(mesh, "--to")
    from ..runner.plan import check_tiling

    for entry in index.tensors.values():  # a source with overlapping chunks or gaps fits no mesh: say so
        check_tiling(entry, lambda _rel: src)  # first, not as a missing tp rule or a --from mismatch
    ctx.progress.start(index.total_tensor_bytes, f"reshard {index.world_size}->{mesh}")
    with frozen_heap(), open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=(src,)) as target:
        files, note = fmt.reshard_mesh(
            opened,
            target,
            mesh,
            ctx,
            source_mesh=expect_from if isinstance(expect_from, MeshSpec) else None,
            tp_dim_for=tp_dims_from_rules(tp_rules),
        )
    ctx.progress.close()
    return ReshardResult(
        out,
        index.format,
        index.world_size,
        mesh.world_size,
        files,
        len(index.tensors),
        index.total_tensor_bytes,
        [f"target {mesh}; {note}"],
    )


def tp_dims_from_rules(path: str | None = None) -> Callable[[str, tuple[int, ...]], int | None]:
    """Each parameter's tp split dim from the split rules (`path`, then the built-in ones), for a
    target mesh with tp over a source saved without it."""
    loaded: list = []

    def dim_for(name: str, shape: tuple[int, ...]) -> int | None:
        if not loaded:
            from ..convert.tp_rules import chosen_rules_file, load_rules

            loaded.append(load_rules(path if path is not None else chosen_rules_file()))
        split = loaded[0].decide(name, shape)
        return None if split.kind == "replicated" else split.dim  # fused blocks: torch's Shard(dim) all the same

    return dim_for


@contextmanager
def rules_file(path: str | None) -> Iterator[None]:
    """The split rules file `path` for the DeepSpeed writers while they run (a library caller's
    tp_rules=); None: the command line's --tp-rules, as it stands."""
    if path is None:
        yield
        return
    from ..convert.tp_rules import chosen_rules_file, use_rules_file

    before = chosen_rules_file()
    use_rules_file(path)
    try:
        yield
    finally:
        use_rules_file(before)


def _writer_with(opened, target: str, refusal: str):
    """The source's format when it is a plain checkpoint whose capabilities say it reshards to
    `target` (TO_MESH, TO_PARALLEL_SIZES); else the UnsupportedError `refusal` with {what} naming
    what the source is (folders are resharded whole)."""
    from .lightning_folder import is_folder

    fmt = format_of(opened.index)
    if opened.trainer is not None or is_folder(opened) or not fmt.capabilities.reshards_to(target):
        what = (
            "an HF Trainer folder"
            if opened.trainer is not None
            else "a Lightning folder"
            if is_folder(opened)
            else f"{opened.index.format} checkpoints"
        )
        raise UnsupportedError(refusal.format(what=what))
    return fmt
