"""Commands on an HF Trainer `checkpoint-N/` folder as a unit (formats/trainer.py says what it holds).

`reshard` (and `convert` to the same kind of folder) write a folder the Trainer resumes from at the
new world size with `trainer.train(resume_from_checkpoint=OUT)`:
  - DeepSpeed: the tag's files rewritten for M ranks under the same tag, `latest` naming it;
  - accelerate FSDP: each DCP subfolder (pytorch_model_fsdp_0/, optimizer_0/) resharded on its own,
    in place of itself, so the Trainer's load_fsdp_model / load_fsdp_optimizer find them;
  - parts that are not laid out per rank (model.safetensors, optimizer.pt, FULL_STATE_DICT files)
    and every side file are copied byte for byte; entries ckptkit does not understand too, and the
    summary names them;
  - the RNG files follow formats.trainer.RNG_POLICY, which the summary states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import CkptkitError, UsageError
from ..formats.accelerate import SubSource
from ..formats.protocols import DcpTarget, ZeroTarget
from ..formats.registry import Opened, format_named
from ..formats.trainer import ACCELERATE, ACCELERATE_RNG_POLICY, RNG_POLICY, TrainerFolder, map_rng, rng_world
from ..index.layouts import fsdp2_layout
from ..runner.fetch import Fetcher
from ..storage.commit import Output
from ..storage.output import open_output
from ..storage.source import Source
from ..context import RunContext

COPY_BLOCK = 8 << 20


class SubOutput:
    """A folder inside an output, seen as an output of its own (what the writers use of one)."""

    def __init__(self, parent: Output, prefix: str) -> None:
        self.parent, self.prefix = parent, prefix.rstrip("/") + "/"
        self.group = parent.group

    def open(self, rel: str):
        return self.parent.open(self.prefix + rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.parent.write_bytes(self.prefix + rel, data)


@dataclass
class FolderResult:
    """What a Trainer folder command wrote: parts rewritten, files copied, the RNG mapping."""

    out: str
    layout: str
    kind: str
    from_world_size: int | None
    to_world_size: int
    parts: list[str]
    copied: list[str]
    rng: dict[str, str]
    rng_left_out: list[str]
    unknown: list[str]
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0

    def notes(self) -> list[str]:
        """The summary lines a command prints after its own (parts, side files, RNG policy)."""
        what = f"{self.kind} folder ({self.layout})"
        lines = [
            f"{what}: rewrote {', '.join(self.parts)} for {self.to_world_size} rank(s)"
            if self.parts
            else f"{what}: no part is laid out per rank; all copied"
        ]
        if self.copied:
            lines.append(f"copied byte for byte: {', '.join(self.copied)}")
        if self.rng:
            mapped = ", ".join(f"{new} <- {old}" for new, old in self.rng.items())
            policy = ACCELERATE_RNG_POLICY if self.kind == ACCELERATE else RNG_POLICY
            lines.append(f"RNG files ({policy}): {mapped}")
        if self.rng_left_out:
            lines.append(
                f"RNG files left out (no rank of {self.to_world_size} takes them): {', '.join(self.rng_left_out)}"
            )
        if self.unknown:
            lines.append(f"not understood, copied as they are: {', '.join(self.unknown)}")
        return lines


def source_world(opened: Opened) -> int | None:
    return opened.index.world_size or rng_world(opened.trainer)


def reshard_folder(opened: Opened, out: str, to: int, ctx: RunContext, src: str) -> FolderResult:
    """`ckptkit reshard` of a Trainer folder: the same kind of folder for `to` ranks."""
    return write_folder(opened, out, to, ctx, src, lambda target: _reshard_parts(opened, target, to, ctx))


def write_folder(
    opened: Opened,
    out: str,
    to: int,
    ctx: RunContext,
    src: str,
    write_parts: Callable[[Output], list[str]],
    sources: tuple = (),
) -> FolderResult:
    """OUT as a Trainer folder: `write_parts` writes the sharded parts into it (their file list),
    then the rest of the source folder is copied and the RNG files mapped to `to` ranks."""
    folder: TrainerFolder = opened.trainer
    if folder.state_problem:
        raise UsageError(f"{src}: is an {folder.kind} folder whose state cannot be read ({folder.state_problem})")
    source = opened.source
    rng, left_out = map_rng(folder.rng_files, to, folder.kind)
    ctx.progress.start(opened.index.total_tensor_bytes, f"reshard {source_world(opened)}->{to}")
    with open_output(out, overwrite=ctx.overwrite, group=ctx.group, sources=(src, *sources)) as target:
        files = write_parts(target)
        written = set(files)
        copied = []
        for part in folder.parts:
            if not part.sharded:
                copied += _copy_tree(source, target, part.name, written)
        for name in folder.side_files:
            copied += _copy_tree(source, target, name, written)
        for name in folder.unknown:
            _copy_tree(source, target, name.rstrip("/"), written)
        for new, old in rng.items():
            _copy_file(source, target, old, new)
        files += copied + list(rng)
    ctx.progress.close()
    sharded = [p.name + "/" for p in folder.parts if p.sharded]
    return FolderResult(
        out,
        folder.layout,
        folder.kind,
        source_world(opened),
        to,
        sharded,
        copied,
        rng,
        left_out,
        list(folder.unknown),
        files,
        len(opened.index.tensors),
        opened.index.total_tensor_bytes,
    )


def _reshard_parts(opened: Opened, target: Output, to: int, ctx: RunContext) -> list[str]:
    folder, source, index = opened.trainer, opened.source, opened.index
    if folder.layout == "deepspeed":
        return format_named("deepspeed").write(ZeroTarget(index, source, to), target, ctx)
    files: list[str] = []
    for part in folder.parts:
        if part.sharded:  # a DCP folder: resharded on its own, under its own name
            files += reshard_dcp_part(source, part.name, target, to, ctx)
    return files


def reshard_dcp_part(source: Source, name: str, target: Output, to: int, ctx: RunContext) -> list[str]:
    """One accelerate DCP subfolder, laid out for `to` ranks into the same subfolder of OUT."""
    sub = SubSource(source, name)
    dcp = format_named("dcp")
    index = dcp.read_index(sub)
    written = dcp.write(DcpTarget(index, Fetcher(sub), fsdp2_layout(index, to), sub), SubOutput(target, name), ctx)
    return [f"{name}/{f}" for f in written]


def _copy_tree(source: Source, target: Output, rel: str, written: set[str]) -> list[str]:
    """Copy the file or folder `rel` byte for byte (files some writer already put in OUT are kept)."""
    if source.isdir(rel):
        out: list[str] = []
        for name in sorted(source.listdir(rel)):
            out += _copy_tree(source, target, f"{rel}/{name}", written)
        return out
    if rel not in written:  # DeepSpeed's writer copies its recovery scripts itself
        _copy_file(source, target, rel, rel)
    return [rel]


def _uncopiable(source: Source, rel: str) -> list[tuple[str, CkptkitError]]:
    """(path, why) for each file under `rel` that _copy_tree would refuse (a FIFO, a device, a
    link leading out, a folder that cannot be listed): what verify reports instead of "ok" about
    a folder reshard and convert then refuse. Only stat()s: nothing is opened or read."""
    try:
        if source.isdir(rel):
            return [bad for name in sorted(source.listdir(rel)) for bad in _uncopiable(source, f"{rel}/{name}")]
        source.size(rel)
    except CkptkitError as exc:
        return [(rel, exc)]
    return []


copy_tree = _copy_tree  # public: the Lightning folder (ops/lightning_folder.py) copies its files the same way


def _copy_file(source: Source, target: Output, rel: str, new: str) -> None:
    """Streamed in blocks (a model.safetensors can be large); rank 0 writes it."""
    if not target.group.is_root:
        return
    size = source.size(rel)
    with target.open(new) as f:
        pos = 0
        while pos < size:
            n = min(COPY_BLOCK, size - pos)
            f.write(source.read(rel, pos, n))
            pos += n


def describe_lines(folder: TrainerFolder) -> list[str]:
    """inspect/verify: the folder's parts, side files, RNG files and what was not understood."""
    step = f", global_step {folder.step if folder.step is not None else '-'}" if folder.kind != ACCELERATE else ""
    lines = [
        f"trainer     {folder.kind} checkpoint ({folder.layout}){step}",
        "parts       "
        + ", ".join(
            f"{p.name}{'/' if p.kind in ('deepspeed', 'dcp-model', 'dcp-optimizer') else ''} ({p.kind})"
            for p in folder.parts
        ),
    ]
    if folder.side_files:
        lines.append("side files  " + ", ".join(folder.side_files))
    if folder.rng_files:
        lines.append(
            "rng files   "
            + ", ".join(folder.rng_files[r] for r in sorted(folder.rng_files, key=lambda r: -1 if r is None else r))
        )
    lines.append("not understood  " + (", ".join(folder.unknown) if folder.unknown else "none"))
    if folder.state_problem:
        lines.append(f"problem     {folder.state_problem}")
    lines += [f"warning     {w}" for w in folder.warnings]
    return lines


__all__ = [
    "reshard_folder",
    "write_folder",
    "reshard_dcp_part",
    "FolderResult",
    "SubOutput",
    "describe_lines",
    "copy_tree",
]


def folder_findings(opened: Opened) -> list:
    """verify: what is wrong with the Trainer folder beyond its parts (an unreadable
    trainer_state.json; a rank's RNG file missing among the others'; an entry reshard would copy
    that it refuses to read)."""
    from ..index import problems as P
    from ..index.problems import Problem

    folder, source = opened.trainer, opened.source
    found = []
    if folder.state_problem:
        found.append(Problem(P.FORMAT, folder.state_problem, source.label("trainer_state.json")))
    copied = [p.name for p in folder.parts if not p.sharded] + folder.side_files + list(folder.rng_files.values())
    for rel in copied + [n.rstrip("/") for n in folder.unknown]:
        found += [Problem(P.kind_of(exc), str(exc), source.label(where)) for where, exc in _uncopiable(source, rel)]
    world = opened.index.world_size
    ranks = {r for r in folder.rng_files if r is not None}
    if world and world > 1 and ranks:
        for r in range(world):
            if r not in ranks:
                name = f"random_states_{r}.pkl" if folder.kind == ACCELERATE else f"rng_state_{r}.pth"
                found.append(
                    Problem(
                        P.MISSING_FILE,
                        f"{source.label(name)}: rank {r}'s RNG file is missing (the "
                        f"others' are there; the Trainer would resume rank {r} without its generator "
                        f"state)",
                        source.label(name),
                    )
                )
    return found


def verify_lines(folder: TrainerFolder, index_files: list[str]) -> list[str]:
    """verify's report on a Trainer folder: every part read (its files are in the index), the
    parts not read (plain optimizer.pt), every entry not understood."""

    def read(p) -> bool:
        return any(f == p.name or f.startswith(p.name + "/") for f in index_files)

    done = ", ".join(
        [p.name + ("/" if p.sharded else "") for p in folder.parts if read(p)]
        + [f"{f} (save_model's copy of the weights)" for f in folder.side_files if f in index_files]
    )
    unread = [p.name for p in folder.parts if not read(p)]
    step = f", global_step {folder.step if folder.step is not None else '-'}" if folder.kind != ACCELERATE else ""
    unread_side = [f for f in folder.side_files if f not in index_files] + sorted(folder.rng_files.values(), key=str)
    return [
        f"  {folder.kind} folder ({folder.layout}{step}): read {done or 'nothing'}"
        + (f"; not read (copied by reshard/convert): {', '.join(unread)}" if unread else ""),
        f"  side files (not read, copied by reshard/convert): {', '.join(unread_side) or 'none'}",
        f"  not understood: {', '.join(folder.unknown) if folder.unknown else 'none'}",
        *(f"  warning: {w}" for w in folder.warnings),
    ]


def same_kind(folder: TrainerFolder, target: str) -> bool:
    """Does convert's `target` (dcp, zero1..3, ...) write this Trainer folder's own kind of part?"""
    return (folder.layout == "deepspeed" and target.startswith("zero")) or (
        folder.layout == "fsdp" and target == "dcp" and all(p.sharded for p in folder.parts)
    )


def convert_folder(
    opened: Opened,
    out: str,
    target: str,
    world: int,
    state,
    cfg: dict | None,
    ctx: RunContext,
    src: str,
    ds_config: str | None,
    reshaped: bool,
) -> FolderResult:
    """`ckptkit convert` of a Trainer folder to its own kind: a Trainer folder again. DeepSpeed: the
    tag rewritten from the training state at the target's stage and world size (convert's ZeRO
    writer); FSDP: each DCP subfolder laid out for `world` ranks. `reshaped`: names or state were
    changed by options (--rename, --drop...), which an accelerate folder cannot carry."""
    if opened.trainer.layout == "fsdp":
        if reshaped:
            raise UsageError(
                f"{src}: --rename, --strip-prefix, --add-prefix, --frozen, --model-only and --drop do "
                f"not apply when an accelerate FSDP Trainer folder is written as one (its DCP "
                f"subfolders are laid out again as they are); convert to another target to change them"
            )
        return write_folder(opened, out, world, ctx, src, lambda t: _reshard_parts(opened, t, world, ctx))
    from ..convert.to_zero import zero_target_from_state

    def parts(t: Output) -> list[str]:
        return format_named("deepspeed").write(zero_target_from_state(state, int(target[-1]), world, cfg), t, ctx)

    return write_folder(opened, out, world, ctx, src, parts, sources=(ds_config,))


def left_behind(folder: TrainerFolder, target: str) -> list[str]:
    """convert to another kind: the Trainer's files the plain target does not hold, named."""
    rest = folder.side_files + sorted(folder.rng_files.values(), key=str) + folder.unknown
    rest += [p.name for p in folder.parts if not p.sharded and p.kind != "weights"]
    if not rest:
        return []
    return [
        f"{folder.kind} folder: --to {target} writes a plain checkpoint, not a Trainer folder; not copied: "
        f"{', '.join(rest)}"
    ]
