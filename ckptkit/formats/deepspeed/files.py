"""Where a DeepSpeed checkpoint's files are: `latest` -> tag folder -> rank files."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...errors import CkptkitError, FormatError, NotACheckpointError, UnsupportedError, quote
from ...index import problems
from ...runner.torch_archive import load_structure, open_archive
from ...storage.source import Source
from .names import EXPERT, EXPERT_ID, LATEST, MAX_LATEST_BYTES, MODEL_STATES, OPTIM_STATES, OFFLOADED_TENSORS
from .names import ANY_MODEL_FILE, ANY_OPTIM_FILE, expert_file, looks_like_tag_folder, optim_file


@dataclass(frozen=True, kw_only=True)
class ZeroFiles:
    """The files of one tag: model-states per rank (one at stage 1/2) and optim-states per rank."""

    tag: str | None  # None when the path given is the tag folder itself
    prefix: str  # "" or "<tag>/", relative to the source root
    model_files: dict[int, str] = field(default_factory=dict)  # dp rank -> name (stage 1/2: {0: ...})
    optim_files: dict[int, str] = field(default_factory=dict)  # dp rank -> name
    bf16_prefix: bool = False
    extra: list[str] = field(default_factory=list)
    mp_rank: int = 0  # the model-parallel rank these model/optim files are of
    # tensor-parallel checkpoints: mp rank -> that rank's files (one ZeRO checkpoint per mp rank);
    # empty when the tag holds model-parallel rank 0 only
    model_parallel: dict[int, "ZeroFiles"] = field(default_factory=dict)
    expert_files: list[str] = field(default_factory=list)  # MoE layer_L_expert_G_* files (moe.py reads them)
    # MoE(enable_expert_tensor_parallelism=False) under an mpu: each expert whole, on one mp rank
    # (join_ep.py reads them across the mp ranks); False when every mp rank holds every expert
    whole_experts: bool = False


def _tag_names(source: Source, rel: str) -> list[str]:
    return source.listdir(rel) if source.isdir(rel) else []


def detect(source: Source) -> bool:
    if not source.isdir(""):
        return False
    names = source.listdir("")
    if LATEST in names and not source.isdir(LATEST):
        return True
    return looks_like_tag_folder(names)


def read_latest(source: Source) -> str:
    """The tag `latest` names: a short line of text. It is read only as far as a tag can go, and
    never shown unquoted (it may be anything: a link, a huge file, escape sequences)."""
    label = source.label(LATEST)
    size = source.size(LATEST)
    head = source.read(LATEST, 0, min(size, MAX_LATEST_BYTES + 1))
    if size > MAX_LATEST_BYTES:
        raise FormatError(
            f"{label}: is {size} bytes, expected a tag name (a folder name of at most "
            f"{MAX_LATEST_BYTES} bytes); it begins {quote(head)}"
        )
    return head.decode("utf-8", "replace").strip()


def locate(source: Source, tag: str | None = None) -> ZeroFiles:
    names = source.listdir("")
    named_by = "--tag" if tag is not None else LATEST
    if tag is None and not looks_like_tag_folder(names):
        if LATEST not in names:
            raise NotACheckpointError(f"{source.label('')}: no `latest` file and no ZeRO rank files")
        tag = read_latest(source)
    if tag is not None:
        if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or not tag.isprintable():
            if named_by == "--tag":  # the user's option, not the checkpoint's `latest`, is at fault
                raise FormatError(f"{source.label('')}: --tag {quote(tag)} is not a folder name")
            raise FormatError(f"{source.label('latest')}: names tag {quote(tag)}, which is not a folder name")
        if not source.isdir(tag):
            raise FormatError(f"{source.label('')}: tag folder is missing ({quote(tag)}, named by `latest` or --tag)")
        prefix = tag + "/"
    else:
        prefix = ""
    files = _rank_files(source, tag, prefix)
    for mp_files in files.model_parallel.values() or [files]:
        _check_ranks(source, mp_files)
    return files


def _rank_files(source: Source, tag: str | None, prefix: str) -> ZeroFiles:
    """The tag folder's files by kind, model-parallel rank and rank; the variants not read yet
    refused by name."""
    model_files: dict[int, dict[int, str]] = {}
    optim_files: dict[int, dict[int, str]] = {}
    extra: list[str] = []
    experts: dict[int, list[str]] = {}  # mp rank -> its expert files
    bf16_prefix = False
    for name in _tag_names(source, prefix.rstrip("/") or ""):
        if m := MODEL_STATES.match(name):
            model_files.setdefault(int(m.group(2)), {})[int(m.group(1) or 0)] = name
        elif m := OPTIM_STATES.match(name):
            optim_files.setdefault(int(m.group(3)), {})[int(m.group(2))] = name
            bf16_prefix = bool(m.group(1))
        elif m := EXPERT.match(name):
            experts.setdefault(int(m.group(1)), []).append(name)
        elif name == OFFLOADED_TENSORS:
            raise UnsupportedError(
                f"{source.label(prefix + name)}: NVMe-offloaded optimizer state "
                f"(offloaded_tensors) is not supported yet"
            )
        else:
            extra.append(name)
    mp_ranks = sorted(set(model_files) | set(optim_files))
    if mp_ranks and mp_ranks != list(range(len(mp_ranks))):
        missing = [r for r in range(max(mp_ranks) + 1) if r not in mp_ranks]
        raise FormatError(
            f"{source.label(prefix or '')}: files of model-parallel rank(s) {missing} are missing "
            f"(found ranks {mp_ranks})"
        )
    stray = sorted(mp for mp in experts if mp not in (mp_ranks or [0]))
    if stray:
        name = sorted(experts[stray[0]])[0]
        raise FormatError(
            f"{source.label(prefix + name)}: expert file of model-parallel rank {stray[0]}, but the "
            f"tag folder has model/optim-states files of model-parallel rank(s) {mp_ranks or [0]} only"
        )
    per_mp = {
        mp: ZeroFiles(
            tag=tag,
            prefix=prefix,
            model_files=model_files.get(mp, {}),
            optim_files=optim_files.get(mp, {}),
            bf16_prefix=bf16_prefix,
            extra=extra,
            mp_rank=mp,
            expert_files=sorted(experts.get(mp, [])),
        )
        for mp in mp_ranks or [0]
    }
    whole = bool(experts) and len(per_mp) > 1 and _experts_whole(source, prefix, experts, list(per_mp))
    lacking = [mp for mp in per_mp if not per_mp[mp].expert_files] if experts and len(per_mp) > 1 else []
    if lacking and not whole:
        # every expert on some mp ranks, none on the others: whole experts at ep 1 (all on mp rank 0),
        # or sliced ones with files lost; the expert groups' partition count tells (join_ep.py)
        if lacking != list(range(1, len(per_mp))) or not moe_whole_at_ep1(
            source, prefix, optim_files.get(0, {}), len(per_mp)
        ):
            raise FormatError(
                f"{source.label(prefix or '')}: model-parallel rank(s) {lacking} have no expert files "
                f"({expert_file('<L>', '<G>', lacking[0])}), the other ranks do"
            )
        whole = True
    if whole:
        per_mp = {mp: replace(f, whole_experts=True) for mp, f in per_mp.items()}
    first = per_mp[0]
    return ZeroFiles(
        tag=tag,
        prefix=prefix,
        model_files=first.model_files,
        optim_files=first.optim_files,
        bf16_prefix=bf16_prefix,
        extra=extra,
        model_parallel=per_mp if len(per_mp) > 1 else {},
        expert_files=first.expert_files,
        whole_experts=whole,
    )


def _experts_whole(source: Source, prefix: str, experts: dict[int, list[str]], mp_ranks: list[int]) -> bool:
    """Which of DeepSpeed's two MoE + TP layouts the expert files are. False: an mp rank holds
    every expert there is (enable_expert_tensor_parallelism=True saves a slice of each on every mp
    rank; the reader names any file missing). True: no expert on two mp ranks (the option left
    False, its default: DeepSpeed 0.19.8 builds the expert-parallel groups from consecutive ranks,
    the tp ranks become expert-parallel ranks, and each expert is saved whole by one of them).
    Anything else is neither, refused naming an expert found on two mp ranks. (With one
    expert-parallel rank the second layout puts every expert on mp rank 0 and is read as the first,
    which then names the other ranks' files as missing.)"""
    held = {mp: {EXPERT_ID.match(n).groups() for n in experts.get(mp, [])} for mp in mp_ranks}
    every = set().union(*held.values())
    if any(held[mp] == every for mp in mp_ranks):
        return False
    owners: dict[tuple, list[int]] = {}
    for mp in mp_ranks:
        for ident in held[mp]:
            owners.setdefault(ident, []).append(mp)
    shared = sorted(((ident, mps) for ident, mps in owners.items() if len(mps) > 1), key=lambda x: str(x))
    if not shared:
        return True
    (layer, expert), mps = shared[0]
    name, other = (expert_file(layer, expert, mp) for mp in mps[:2])
    raise FormatError(
        f"{source.label(prefix + name)}: expert {expert} of MoE layer {layer or 0} is saved by "
        f"model-parallel ranks {mps} (also as {other}), while no mp rank holds every expert; "
        f"DeepSpeed saves each "
        f"expert either on every mp rank (MoE(enable_expert_tensor_parallelism=True), a slice on "
        f"each) or whole on exactly one (enable_expert_tensor_parallelism=False)"
    )


def moe_whole_at_ep1(source: Source, prefix: str, optim_files: dict[int, str], tp: int) -> bool:
    """Whole experts at expert-parallel size 1 with tp ranks (every expert saved by global rank 0,
    mp rank 0): mp rank 0's first optim-states file partitions its expert groups (ep_size_1) over
    all tp x dp ranks, where sliced experts at ep 1 are partitioned over the dp ranks of a tp lane."""
    if not optim_files:
        return False
    try:
        osd = load_structure(open_archive(source, prefix + optim_files[min(optim_files)]), eager=False)
        osd = osd["optimizer_state_dict"]
        groups = osd["base_optimizer_state"]["param_groups"]
        counts = osd["partition_count"]
        expert = [i for i, g in enumerate(groups) if isinstance(g, dict) and g.get("moe")]
        return bool(expert) and all(
            groups[i].get("name") == "ep_size_1" and counts[i] == tp * len(optim_files) for i in expert
        )
    except (CkptkitError, KeyError, TypeError, IndexError, AttributeError):
        return False  # the reader names what is wrong with the file


def _check_ranks(source: Source, files: ZeroFiles) -> None:
    """Model-states and optim-states files are there, and no rank's optim-states file is missing
    (verify: each missing one listed, the others still read)."""
    prefix = files.prefix
    if not files.model_files:
        which = f" of model-parallel rank {files.mp_rank}" if files.mp_rank else ""
        why = ""
        if files.whole_experts:
            why = (
                " (DeepSpeed 0.19.8 saves none for it when MoE experts are whole, "
                "enable_expert_tensor_parallelism=False, with an expert-parallel size below the tensor-parallel "
                "size: only global ranks below ep write model states, so mp ranks >= ep lose their module "
                "weights; DeepSpeed cannot load such a checkpoint either)"
            )
        raise FormatError(
            f"{source.label(prefix or '')}: no {ANY_MODEL_FILE} file{which} in the DeepSpeed tag folder{why}"
        )
    if not files.optim_files:
        which = f" of model-parallel rank {files.mp_rank}" if files.mp_rank else ""
        raise FormatError(
            f"{source.label(prefix or '')}: no {ANY_OPTIM_FILE} files{which} (a checkpoint saved "
            f"without optimizer state cannot be read yet)"
        )
    world = max(files.optim_files) + 1
    missing = [r for r in range(world) if r not in files.optim_files]
    if missing:
        error = FormatError(
            f"{source.label(prefix or '')}: optim-states files for rank(s) {missing} are missing "
            f"(found {len(files.optim_files)} of {world})"
        )
        if not problems.collecting_now():
            raise error
        for rank in missing:  # verify: one problem per missing file, the other ranks still checked
            name = optim_file(rank, files.bf16_prefix, files.mp_rank)
            problems.tolerate(
                FormatError(f"{source.label(prefix + name)}: file is missing (rank {rank} of {world})"),
                source.label(prefix + name),
            )
