"""Hugging Face Trainer `checkpoint-N/` folders: which entries are checkpoint parts, which are the
trainer's side files, and which ckptkit does not understand.

A Trainer folder is `trainer_state.json` beside one of
  deepspeed  `latest` and the tag folder it names (`global_stepN/`), written by engine.save_checkpoint
  fsdp       accelerate's DCP folders `pytorch_model_fsdp_<i>/` and `optimizer_<i>/` (FSDP1 or FSDP2,
             SHARDED_STATE_DICT), or its one-file FULL_STATE_DICT `pytorch_model_fsdp[_<i>].bin` and
             `optimizer[_<i>].bin`
  plain      the model files save_model writes (model.safetensors, sharded or not, pytorch_model.bin)
             and `optimizer.pt` (DDP or one process)
Everything else the Trainer writes (trainer_state.json, training_args.bin, scheduler.pt,
rng_state_<r>.pth, config.json, tokenizer files, DeepSpeed's zero_to_fp32.py...) is a side file:
commands that write a Trainer folder copy it byte for byte. Nothing here unpickles anything:
training_args.bin and the RNG files are only ever copied.

The step is the one trainer_state.json records (`global_step`). A folder named `checkpoint-N`
whose N is another step (copied, renamed, or saved by a script that numbers otherwise) keeps the
recorded step and carries a warning saying both (`TrainerFolder.warnings`, shown by inspect and
verify); a run folder still orders its `checkpoint-N` entries by N, as transformers'
get_last_checkpoint does (formats/run_folder.py).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from .. import safe_json
from ..errors import CkptkitError
from ..storage.source import Source
from .accelerate import MODEL_DIR, OPTIM_DIR, SubSource
from .dcp import reader as dcp_reader
from .deepspeed.names import HELPER_SCRIPTS, LATEST

TRAINER_STATE = "trainer_state.json"
RNG_SINGLE = "rng_state.pth"
NAMED_STEP = re.compile(r"checkpoint-([0-9]+)", re.ASCII)  # the Trainer's folder name (fullmatch)
# Names are matched whole (fullmatch: "$" would let a trailing line break in) and in ASCII digits
# only ("\d" takes any script's digits, which int() reads as the same rank)
RNG_RANK = re.compile(r"rng_state_([0-9]+)\.pth", re.ASCII)
MAX_STATE_BYTES = 64 << 20  # log_history grows with the run; a few MB in long ones

# The trainer's own files, by name: copied as bytes, never parsed beyond trainer_state.json.
SIDE_FILES = {
    TRAINER_STATE: "Trainer state (global step, log history)",
    "training_args.bin": "TrainingArguments (a pickle: copied, never read)",
    "scheduler.pt": "learning-rate scheduler state",
    "scaler.pt": "gradient scaler state",
    "config.json": "model config",
    "generation_config.json": "generation config",
    **{script: "DeepSpeed's recovery script" for script in HELPER_SCRIPTS},
    "README.md": "model card",
    "adapter_config.json": "PEFT adapter config",
    "preprocessor_config.json": "processor config",
    "processor_config.json": "processor config",
    "chat_template.jinja": "tokenizer chat template",
    "chat_template.json": "tokenizer chat template",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model|adapter_model)(-[0-9]{5}-of-[0-9]{5})?\.(safetensors|bin)(\.index\.json)?\Z", re.ASCII
)
FULL_FSDP_FILE = re.compile(r"^(pytorch_model_fsdp|optimizer)(_[0-9]+)?\.bin\Z", re.ASCII)
OPTIMIZER_FILE = "optimizer.pt"
# accelerate's save_state() beside its DCP folders (no trainer_state.json): its own side files
ACCELERATE_RNG = re.compile(r"random_states_([0-9]+)\.pkl", re.ASCII)
ACCELERATE_SIDE = re.compile(
    r"^((scheduler|sampler|dl_state_dict)(_[0-9]+)?\.bin|scaler\.pt|custom_checkpoint_[0-9]+\.pkl)\Z", re.ASCII
)
TRAINER, ACCELERATE = "HF Trainer", "accelerate"


@dataclass
class Part:
    """One checkpoint part: `name` is its entry in the folder (a file or a folder)."""

    name: str
    kind: str  # deepspeed | dcp-model | dcp-optimizer | full-state-dict | weights | optimizer
    sharded: bool  # laid out per rank (resharded), or world-size free (copied as it is)


@dataclass
class TrainerFolder:
    """What a Trainer checkpoint folder holds, entry by entry (names relative to the folder)."""

    layout: str  # deepspeed | fsdp | plain
    parts: list[Part]
    side_files: list[str]
    rng_files: dict[int | None, str]  # rank -> file; None: rng_state.pth (a one-process run)
    unknown: list[str]
    step: int | None = None
    state_problem: str | None = None  # trainer_state.json unreadable (said by verify)
    notes: list[str] = field(default_factory=list)
    kind: str = TRAINER  # HF Trainer (trainer_state.json) or accelerate (save_state's folder alone)
    warnings: list[str] = field(default_factory=list)  # what looks wrong but does not stop a read

    def as_json(self) -> dict:
        return {
            "kind": self.kind,
            "layout": self.layout,
            "step": self.step,
            "parts": [{"name": p.name, "kind": p.kind, "sharded": p.sharded} for p in self.parts],
            "side_files": self.side_files,
            "rng_files": {
                ("single" if r is None else str(r)): f
                for r, f in sorted(self.rng_files.items(), key=lambda kv: -1 if kv[0] is None else kv[0])
            },
            "not_understood": self.unknown,
            **({"state_problem": self.state_problem} if self.state_problem else {}),
            **({"warnings": self.warnings} if self.warnings else {}),
        }


def describe(source: Source, tag: str | None = None) -> TrainerFolder | None:
    """The Trainer folder at `source`, or None when it is not one (no trainer_state.json beside a
    DeepSpeed, accelerate FSDP or model part). `tag` picks the DeepSpeed tag (default: `latest`'s).
    accelerate's save_state() folder (its DCP subfolders, no trainer_state.json) is one too, of
    kind "accelerate": the same unit, with accelerate's own side and RNG file names."""
    try:
        if not source.isdir(""):
            return None
        names = sorted(source.listdir(""))
        trainer = source.exists(TRAINER_STATE) and not source.isdir(TRAINER_STATE)
    except CkptkitError:
        return None
    parts, layout = _parts(source, names, tag)
    if not parts or not trainer and not (layout == "fsdp" and parts[0].sharded):
        return None
    kind = TRAINER if trainer else ACCELERATE
    taken = {p.name for p in parts} | ({LATEST} if layout == "deepspeed" else set())
    side, rng, unknown = [], {}, []
    for name in names:
        if name in taken:
            continue
        what = _side_kind(source, name, kind)
        if what == "rng":
            rng[rng_rank(name, kind)] = name  # one canonical name per rank: none overwrites another
        elif what == "side":
            side.append(name)
        else:
            unknown.append(name + ("/" if _isdir(source, name) else ""))
    step, problem = _read_step(source) if trainer else (None, None)
    return TrainerFolder(
        layout, parts, side, rng, unknown, step, problem, kind=kind, warnings=step_name_mismatch(source.root, step)
    )


def step_name_mismatch(root: str, step: int | None) -> list[str]:
    """A warning when the folder is named `checkpoint-N` and trainer_state.json records another
    global_step: the step shown is the recorded one, and a reader of the name would expect N."""
    name = posixpath.basename(root.replace("\\", "/").rstrip("/"))
    m = NAMED_STEP.fullmatch(name)
    if m is None or step is None or int(m.group(1)) == step:
        return []
    return [f"folder name {name} says step {int(m.group(1))}, but {TRAINER_STATE} records global_step {step}"]


def _isdir(source: Source, name: str) -> bool:
    try:
        return source.isdir(name)
    except CkptkitError:
        return False


def _parts(source: Source, names: list[str], tag: str | None) -> tuple[list[Part], str]:
    if LATEST in names and not _isdir(source, LATEST) or tag is not None:
        chosen = tag or _read_latest(source)
        if chosen and chosen in names and _isdir(source, chosen):
            return [Part(chosen, "deepspeed", True)], "deepspeed"
    dcp = [
        n
        for n in names
        if (MODEL_DIR.match(n) or OPTIM_DIR.match(n)) and _isdir(source, n) and dcp_reader.detect(SubSource(source, n))
    ]
    if dcp:
        dcp.sort(key=lambda n: (0 if MODEL_DIR.match(n) else 1, n))
        return [Part(n, "dcp-model" if MODEL_DIR.match(n) else "dcp-optimizer", True) for n in dcp], "fsdp"
    full = sorted(
        (n for n in names if FULL_FSDP_FILE.match(n) and not _isdir(source, n)),
        key=lambda n: (0 if n.startswith("pytorch_model_fsdp") else 1, n),
    )
    if any(n.startswith("pytorch_model_fsdp") for n in full):
        return [Part(n, "full-state-dict", False) for n in full], "fsdp"
    weights = [n for n in names if WEIGHT_FILE.match(n) and not _isdir(source, n)]
    if weights:
        parts = [Part(n, "weights", False) for n in weights]
        if OPTIMIZER_FILE in names:
            parts.append(Part(OPTIMIZER_FILE, "optimizer", False))
        return parts, "plain"
    return [], ""


def _read_latest(source: Source) -> str | None:
    try:
        size = source.size(LATEST)
        if size > 4096:
            return None
        return source.read(LATEST, 0, size).decode("utf-8").strip() or None
    except (CkptkitError, UnicodeDecodeError):
        return None


def _side_kind(source: Source, name: str, kind: str) -> str:
    if _isdir(source, name):
        return "unknown"
    if kind == ACCELERATE:
        return "rng" if rng_rank(name, kind) is not None else "side" if ACCELERATE_SIDE.match(name) else "unknown"
    if rng_rank(name, kind) is not None or name == RNG_SINGLE:
        return "rng"
    if name in SIDE_FILES or name in TOKENIZER_FILES:
        return "side"
    if WEIGHT_FILE.match(name):  # save_model's copy of the weights beside a DeepSpeed/FSDP part
        return "side"
    return "unknown"


def rng_rank(name: str, kind: str = TRAINER) -> int | None:
    """The rank an RNG file is for, read only from the name its writer gives it (rng_state_1.pth,
    random_states_1.pkl): None for any other spelling (rng_state_01.pth, a rank in non-ASCII
    digits), which is then an entry not understood, copied and named, never taken for the rank's
    own file. None too for rng_state.pth (the one-process file, which describe keys by None)."""
    m = (ACCELERATE_RNG if kind == ACCELERATE else RNG_RANK).fullmatch(name)
    if m is None or str(int(m.group(1))) != m.group(1):
        return None
    return int(m.group(1))


def _read_step(source: Source) -> tuple[int | None, str | None]:
    """global_step from trainer_state.json, or (None, the sentence saying why not)."""
    label = source.label(TRAINER_STATE)
    try:
        size = source.size(TRAINER_STATE)
        if size > MAX_STATE_BYTES:
            return None, f"{label}: is {size:,} bytes, more than the {MAX_STATE_BYTES:,} a Trainer state holds"
        doc = safe_json.loads(source.read(TRAINER_STATE, 0, size), label, "the Trainer state", bounded=True)
    except CkptkitError as exc:
        return None, str(exc)
    step = doc.get("global_step") if isinstance(doc, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None, f"{label}: has no global_step (a non-negative integer)"
    return step, None


def rng_world(folder: TrainerFolder) -> int | None:
    """The world size the RNG files were written for (rng_state.pth: one process)."""
    ranks = [r for r in folder.rng_files if r is not None]
    if ranks:
        return max(ranks) + 1
    return 1 if None in folder.rng_files else None


RNG_POLICY = (
    "new rank r takes old rank (r mod N)'s file, N the old world size; one process reads "
    "rng_state.pth, which takes old rank 0's"
)
ACCELERATE_RNG_POLICY = "new rank r takes old rank (r mod N)'s file, N the old world size"


def map_rng(rng_files: dict[int | None, str], to: int, kind: str = TRAINER) -> tuple[dict[str, str], list[str]]:
    """RNG_POLICY: (new file name -> old file name, old files left out). The Trainer reads
    rng_state_{process_index}.pth when the world size is above 1, else rng_state.pth, and skips
    restoring (with a log line) when its file is missing; resuming with another rank's generator
    state is what a restart at a new world size can offer."""
    if not rng_files:
        return {}, []
    ranks = sorted(r for r in rng_files if r is not None)
    olds = [rng_files[r] for r in ranks] if ranks else [rng_files[None]]
    if kind == ACCELERATE:  # accelerate reads random_states_{process_index}.pkl, at any world size
        new = {f"random_states_{r}.pkl": olds[r % len(olds)] for r in range(to)}
    elif to == 1:
        new = {RNG_SINGLE: olds[0]}
    else:
        new = {f"rng_state_{r}.pth": olds[r % len(olds)] for r in range(to)}
    used = set(new.values())
    left_out = [f for f in rng_files.values() if f not in used]
    return new, sorted(left_out, key=_rank_order)


def _rank_order(name: str) -> tuple[int, str]:
    rank = rng_rank(name, ACCELERATE if name.endswith(".pkl") else TRAINER)
    return (-1 if rank is None else rank, name)


__all__ = ["TrainerFolder", "Part", "describe", "map_rng", "rng_world", "RNG_POLICY", "TRAINER_STATE"]
