"""`Checkpointer`: save, retain and resume a training run, also after the cluster changed size.

    ckpt = Checkpointer("/ckpts/run1", keep=3, async_save=False)
    step = ckpt.restore(model, optimizer, states={"sched": scheduler})   # None on a fresh start
    ...
    ckpt.save(step, model, optimizer, extra={"epoch": epoch}, states={"sched": scheduler})

Each checkpoint is a folder `step_000000042` written as a hidden temporary sibling; every rank
adds its RNG state (rng.py); once every rank's save returned, rank 0 writes the completion marker
into it (steps.py), renames it into place, applies retention and updates the pointer file
`latest` (pointer.py).
Only folders the marker (or, for folders from before markers, ckptkit's reader) proves complete
count: restore skips the rest and names them, retention deletes only marked ones, never the
step just written. A crash leaves a hidden temporary that restore sweeps. Torch modules (plain,
DDP, FSDP2) are saved as DCP with `get_state_dict`; DeepSpeed engines with their own
`save_checkpoint` (the native ZeRO layout). Restore loads at the current world size whatever
size wrote it: torch modules through `ckptkit.load` (each rank reads its own shards), DeepSpeed
engines through a distributed `reshard` first when the data-parallel size changed.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import threading
import uuid
import warnings
from typing import Any, Callable

import torch

from ..errors import CkptkitError, FormatError, OutputError, UsageError
from ..runner.distributed import Group, PeerError, group_of
from ..storage.output import open_output
from ..storage.source import is_url, path_text
from ..storage.rename_output import recover
from . import engine_io, pointer, rng
from . import steps as step_folders
from .rng import RngNotRestoredWarning  # noqa: F401  (re-exported: restore warns with it)
from .saved import STATES, check_restorable, has_prefix, rank_key, template
from .steps import Folder
from .states import check_states as _check_states, refuse_other_keys as _refuse_other_keys
from .states import state_dicts as _state_dicts, validate as validate_states

TMP_MARK = ".ckptkit-tmp-"
# what a RenameOutput leaves next to a step when a save is killed (storage/rename_output.py, locks.py):
# `.step_N.ckptkit-tmp-T`, `.step_N.ckptkit-old-T`, `.step_N.ckptkit-lock[-T]`, older `step_N.ckptkit-old-T`
LEFTOVER = re.compile(
    r"\.(step_[0-9]+)\.ckptkit-(?:tmp-|old-|lock).*|(step_[0-9]+)\.ckptkit-old-[0-9a-f]+", re.ASCII | re.DOTALL
)
SHOWN = 10  # skipped folders named in the warning
ENGINE_STATES = "ckptkit_states"  # the client-state entry holding `states` for DeepSpeed engines


class SkippedStepsWarning(UserWarning):
    """restore() passed over folders named like steps that are not complete checkpoints."""


def _is_engine(obj: Any) -> bool:
    """A DeepSpeed engine, recognised without importing deepspeed."""
    return all(hasattr(obj, a) for a in ("save_checkpoint", "load_checkpoint", "module", "global_steps"))


class Checkpointer:
    """Saves into `directory/step_<N>`, keeps the newest `keep`, restores the newest complete one.
    With `rng` (the default) each rank's random generators are saved and restored too."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = False, rng: bool = True) -> None:
        directory = path_text(directory, "Checkpointer")
        if type(keep) is not int or keep < 1:  # 1.5 or nan would never equal a count: every step kept
            raise UsageError(f"keep must be an int of at least 1 (got {keep!r:.60})")
        if is_url(directory):
            raise UsageError(
                f"{directory}: the Checkpointer saves to a local or mounted folder, not a URL "
                f"(the ranks write in place and rename; an object store cannot rename)"
            )
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.async_save = async_save
        self.rng = rng
        self.extra: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._bg_pg: Any = None
        # the CPU copies the last async save staged, free again once it is written: the next save
        # copies into them (same shapes and dtypes) instead of allocating, and faulting in, the
        # state's size in fresh memory each time (pinned memory, for a GPU's state, is slower yet)
        self._staging: list[torch.Tensor] = []
        self._group = group_of()
        if self._group.is_root:
            _make_folder(self.directory)
        if async_save and self._group.distributed:
            import torch.distributed as dist

            # background saves talk over their own group, never interleaving with training's
            self._bg_pg = dist.new_group(backend="gloo")

    # ---- listing -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (strays are not listed)."""
        names = step_folders.scan(self.directory)
        return [s for s in sorted(names) if self._complete(s, names[s]) is not None]

    def path(self, step: int) -> str:
        """The folder of `step`'s complete checkpoint, whichever spelling; where save(step) would
        write it when there is none."""
        _check_step(step)
        names = step_folders.scan(self.directory).get(step, [])
        found = self._complete(step, names)
        return os.path.join(self.directory, found.name if found else step_folders.default_name(step))

    def _complete(self, step: int, names: list[str]) -> Folder | None:
        """The complete folder of `step` among `names`; two of them are an error naming both."""
        good = [f for n in names if (f := step_folders.examine(self.directory, n, step)).complete]
        if len(good) > 1:
            raise step_folders.duplicate_error(self.directory, step, [f.name for f in good])
        return good[0] if good else None

    def _on_root(self, fn: Callable[[], Any], group: Group | None = None) -> Any:
        """`fn()` decided by rank 0 (the directory is shared), its result or its error on every rank.
        A CkptkitError (a refusal: step already saved, no such step...) is raised as itself on every
        rank at the same call, and the Checkpointer stays usable; anything else fails the group.
        Only rank 0 runs anything, so one broadcast of its outcome is all the ranks need to hear
        (what group.check and group.share would tell them, in half the collectives)."""
        group = group or self._group
        result, refusal, error = None, None, None
        if group.is_root:
            try:
                result = fn()
            except CkptkitError as exc:
                refusal = exc
            except BaseException as exc:  # every rank must hear of it
                error = exc
        if not group.distributed:
            if error is not None:
                raise error
        else:
            if group.failed is not None:  # as group.check: after a failure no collective runs again
                raise error if error is not None else group.failed
            report = None if error is None else (type(error).__name__, str(error), isinstance(error, CkptkitError))
            result, refusal, report = group.share((result, refusal, report))
            if error is not None:
                group.failed = error
                raise error
            if report is not None:
                kind, message, ours = report
                group.failed = PeerError(message if ours else f"rank 0 failed: {kind}: {message}")
                raise group.failed
        if refusal is not None:
            raise refusal
        return result

    # ---- saving --------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: Any,
        optimizer: Any = None,
        extra: dict | None = None,
        states: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        """Collective. Save `step`; with async_save return once a CPU copy is staged. `states`
        maps names to objects with state_dict()/load_state_dict() (a scheduler, a dataloader),
        each rank's saved apart. Anything already at `step` (a checkpoint or a stray) is
        replaced only with `overwrite`."""
        self._raise_background()
        self.wait()
        _check_step(step)
        _check_model(model)
        engine = _is_engine(model)
        if engine and optimizer is not None and extra is None and isinstance(optimizer, dict):
            extra, optimizer = optimizer, None
        if extra is not None and not isinstance(extra, dict):
            raise UsageError(f"extra must be a dict of name -> value, or None (got {type(extra).__name__})")
        saved_states = _state_dicts(states)
        # checked before anything is written: a step restore would refuse is never committed
        if engine:
            self._agree_restorable(
                {"extra": extra or {}, STATES: {rank_key(self._group.rank): saved_states}}, dcp=False
            )
        else:
            state = self._torch_state(step, model, optimizer, extra, saved_states)
        name = self._on_root(lambda: self._target(step, overwrite))
        rng_doc = rng.capture(self._group.world, self._group.rank) if self.rng else None
        if engine:
            self._save_engine(step, name, model, extra, saved_states, rng_doc, overwrite)
            return
        if not self.async_save:
            self._write(step, name, overwrite, state, rng_doc, self._group, None)
            return
        staged, self._staging = _stage(state, self._staging)
        group = group_of(self._bg_pg) if self._bg_pg is not None else self._group
        self._thread = threading.Thread(
            target=self._background,
            args=(step, name, overwrite, staged, rng_doc, group),
            name=f"ckptkit-save-{step}",
            daemon=True,
        )
        self._thread.start()

    def _torch_state(self, step: int, model: Any, optimizer: Any, extra: dict | None, saved_states: dict) -> dict:
        """The DCP state dict of a step, once every rank found each value in it restorable."""
        state = self._state_dict(model, optimizer)
        state["extra"] = extra or {}
        if saved_states:
            state[STATES] = {rank_key(self._group.rank): saved_states}
        state["ckptkit"] = {"step": step}
        self._agree_restorable(state, dcp=True)
        state["extra"] = copy.deepcopy(extra) if extra else {}  # the values at the call (async_save)
        return state

    def _agree_restorable(self, state: dict, dcp: bool) -> None:
        """Collective: every rank checks its own state (states differ by rank); a refusal on any
        rank is raised on all of them, and the Checkpointer stays usable. For DCP two entries that
        flatten to one name are refused too (a DeepSpeed engine pickles its client state whole)."""
        from ..api import agree, flat_leaves
        from ..index.flatten import flatten

        refusal = None
        try:
            if dcp:
                _refuse_other_keys(state.get("extra"), "extra")
                _refuse_other_keys(state.get(STATES), "states")
            leaves = flat_leaves(state) if dcp else flatten(state, lambda v: isinstance(v, torch.Tensor))
            check_restorable(leaves)
        except UsageError as exc:
            refusal = exc
        agree(self._group, refusal)

    def _target(self, step: int, overwrite: bool) -> str:
        """The folder name save(step) writes: the default spelling, or with `overwrite` the one
        already there (so no second spelling appears). Without it, anything there is refused."""
        names = step_folders.scan(self.directory).get(step, [])
        if not names:
            return step_folders.default_name(step)
        found = self._complete(step, names)
        if not overwrite:
            if found is not None:
                raise OutputError(
                    f"{os.path.join(self.directory, found.name)}: step {step} is already saved (a "
                    f"complete checkpoint); pass overwrite=True to replace it"
                )
            stray = step_folders.examine(self.directory, names[0], step)
            raise OutputError(
                f"{os.path.join(self.directory, stray.name)}: is in the way of step {step} and is not "
                f"a complete checkpoint (it {stray.why}); ckptkit leaves it alone: move it away or "
                f"pass overwrite=True to replace it"
            )
        if found is not None:
            return found.name
        return step_folders.default_name(step) if step_folders.default_name(step) in names else names[0]

    def wait(self) -> None:
        """Join a background save (its failure is raised here, or by the next call)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_background()

    def _raise_background(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(
        self, step: int, name: str, overwrite: bool, state: dict, rng_doc: dict | None, group: Group
    ) -> None:
        try:
            self._write(step, name, overwrite, state, rng_doc, group, self._bg_pg)
        except BaseException as exc:  # raised by the next call on this rank
            self._error = exc

    def _write(
        self, step: int, name: str, overwrite: bool, state: dict, rng_doc: dict | None, group: Group, pg: Any
    ) -> None:
        from ..api import write_dcp

        with open_output(os.path.join(self.directory, name), overwrite=overwrite, group=group) as out:
            write_dcp(state, out.tmp, pg)  # `group` is group_of(pg)
            if rng_doc is not None:
                rng.write(out.tmp, rng_doc)
            self._mark(out.tmp, step, "dcp", group)
        self._retain(group, step)

    def _save_engine(
        self, step: int, name: str, engine: Any, extra: dict | None, states: dict, rng_doc: dict | None, overwrite: bool
    ) -> None:
        client = dict(extra or {})
        if states:  # DeepSpeed keeps client state as its saving rank gave it
            client[ENGINE_STATES] = states
        with open_output(os.path.join(self.directory, name), overwrite=overwrite, group=self._group) as out:
            engine_io.save(engine, out.tmp, step, client)
            if rng_doc is not None:
                rng.write(out.tmp, rng_doc)
            self._mark(out.tmp, step, "deepspeed", self._group)
        self._retain(self._group, step)

    @staticmethod
    def _mark(tmp: str, step: int, fmt: str, group: Group) -> None:
        """The completion marker, last: once every rank's save returned (a failure anywhere makes
        the output abandon the folder on every rank), before the commit renames it into place."""
        group.check(None)
        if group.is_root:
            step_folders.write_marker(tmp, step, fmt, group.world)

    def _retain(self, group: Group, written: int) -> None:
        """Rank 0 keeps the newest `keep` complete steps and `written`; of the others it deletes
        only folders ckptkit's marker proves complete. Strays, user files and folders from before
        markers are never touched. A folder is renamed to a hidden temporary before it is
        removed, so a crash half-way leaves something the next restore sweeps, not a torso.
        Last, the pointer file names the newest complete step."""
        if not group.is_root:
            return
        names = step_folders.scan(self.directory)
        newest: list[int] = []
        newest_name = ""
        for step in sorted(names, reverse=True):
            if len(newest) == self.keep:
                break
            complete = [n for n in names[step] if step_folders.examine(self.directory, n, step).complete]
            if complete:
                newest.append(step)
                newest_name = newest_name or complete[0]
        for step in sorted(set(names) - set(newest) - {written}):
            for n in names[step]:
                if step_folders.examine(self.directory, n, step, verify_unmarked=False).marked:
                    _remove(self.directory, n)
        if newest_name:
            try:
                pointer.write(self.directory, newest_name)
            except OSError as exc:  # the step is saved; restore never needs the pointer
                warnings.warn(
                    f"{self.directory}: could not update {pointer.NAME} to {newest_name} "
                    f"({exc.strerror}); restore lists the folder instead",
                    stacklevel=4,
                )

    @staticmethod
    def _state_dict(model: Any, optimizer: Any) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optim": osd}

    # ---- restoring -----------------------------------------------------------------------

    def restore(
        self, model: Any, optimizer: Any = None, states: dict[str, Any] | None = None, step: int | None = None
    ) -> int | None:
        """Collective. Load the newest complete checkpoint (or that of `step`) at the current world
        size; its step, or None when there is none. `extra` then holds what save() was given;
        each of `states` gets its saved state_dict(); the random generators are put back when
        the world size is the one that saved (else an RngNotRestoredWarning). Folders named like
        newer steps that are not complete checkpoints are skipped, and named in a
        SkippedStepsWarning."""
        self.wait()
        if step is not None:
            _check_step(step)
        _check_model(model)
        validate_states(states or {})  # a fresh start too: the next save would refuse them
        found, skipped = self._on_root(lambda: self._sweep_and_choose(step))
        if skipped and self._group.is_root:
            _warn_skipped(self.directory, found, skipped)
        if found is None:
            self.extra = None
            return None
        path = os.path.join(self.directory, found.name)
        rng_doc, rng_why = self._read_rng(path) if self.rng else (None, None)  # refused before anything loads
        if _is_engine(model):
            self._restore_engine(found.step, path, model, states or {})
        else:
            self._restore_torch(path, model, optimizer, states or {})
        if rng_doc is not None:
            rng.apply(rng_doc)
        elif rng_why is not None and self._group.is_root:
            warnings.warn(
                f"{path}: step {found.step} {rng_why}; the random generators are left as they are",
                RngNotRestoredWarning,
                stacklevel=2,
            )
        return found.step

    def _restore_torch(self, path: str, model: Any, optimizer: Any, states: dict[str, Any]) -> None:
        from ..api import load_opened
        from ..formats.registry import open_checkpoint
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        opened = open_checkpoint(path)  # read once: for the templates and for the load
        index = opened.index
        state = self._state_dict(model, optimizer)
        extra = template(index, ("extra",))
        if extra is not None:
            state["extra"] = extra
        rk = ""
        if states:
            rk = self._states_rank(index)
            saved = template(index, (STATES, rk)) or {}
            _check_states(path, states, saved)
            state[STATES] = {rk: {k: saved[k] for k in states}}
        load_opened(state, opened, path)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for k, obj in states.items():
            obj.load_state_dict(state[STATES][rk][k])
        self.extra = state.get("extra") or {}

    def _states_rank(self, index: Any) -> str:
        """Whose states this rank loads: its own rank's, or rank 0's for a rank the saving run
        did not have (a larger world size)."""
        own = rank_key(self._group.rank)
        return own if has_prefix(index, (STATES, own)) else rank_key(0)

    def _read_rng(self, path: str) -> tuple[dict | None, str | None]:
        """(this rank's generator states to put back, or None and why not). Read before anything
        is loaded, so an unusable RNG file is refused with nothing changed. The states are put
        back when the world size is the saved one; otherwise (or when the step has none) rank 0
        warns once and the generators stay. A rank whose file is refused makes every rank refuse
        it, at the same call (each rank reads only its own file)."""

        def saved_world() -> int | None:
            doc = rng.read(path, 0)
            return doc["world_size"] if doc is not None else None

        world = self._on_root(saved_world)
        if world is None:
            return None, "was saved without RNG state"
        if world != self._group.world:
            return None, f"was saved at world size {world}, this run has {self._group.world}"
        doc, refusal = None, None
        try:
            doc = rng.read(path, self._group.rank)
        except FormatError as exc:
            refusal = exc
        refused = [r for r in self._group.gather_all(None if refusal is None else str(refusal)) if r is not None]
        if refusal is not None:
            raise refusal
        if refused:
            raise FormatError(refused[0])
        if doc is None:  # rank 0 has a file, this rank none
            return None, "was saved without RNG state"
        return doc, None

    def _choose(self, step: int | None) -> tuple[Folder | None, list[Folder]]:
        """(the folder to restore, the strays newer than it, newest first). Only as many folders
        are opened as it takes to find the newest complete one."""
        names = step_folders.scan(self.directory)
        if step is not None:
            found = self._complete(step, names.get(step, []))
            if found is None:
                have = ", ".join(map(str, self.steps()[-8:])) or "none"
                raise UsageError(
                    f"{self.directory}: has no complete checkpoint of step {step} (complete steps, newest last: {have})"
                )
            return found, []
        latest = pointer.read(self.directory)
        newest = max(names, default=None)
        if latest is not None and newest is not None and names[newest] == [latest]:
            found = self._complete(newest, names[newest])  # the pointer, trusted once checked
            if found is not None and found.name == latest:
                return found, []
        skipped: list[Folder] = []
        for s in sorted(names, reverse=True):
            folders = [step_folders.examine(self.directory, n, s) for n in names[s]]
            good = [f for f in folders if f.complete]
            skipped += [f for f in folders if not f.complete]
            if len(good) > 1:
                raise step_folders.duplicate_error(self.directory, s, [f.name for f in good])
            if good:
                return good[0], skipped
        return None, skipped

    def _restore_engine(self, step: int, path: str, engine: Any, states: dict[str, Any]) -> None:
        from ..formats.registry import open_checkpoint
        from ..context import RunContext
        from ..ops.reshard import reshard

        saved_world = open_checkpoint(path).index.world_size
        world = int(getattr(engine, "dp_world_size", self._group.world))
        load_from, scratch = path, None
        if saved_world != world:  # DeepSpeed refuses another size: reshard on the fly, in parallel
            scratch = os.path.join(self.directory, f".resume-step_{step:09d}-w{world}")
            if self._group.is_root and os.path.exists(scratch):
                shutil.rmtree(scratch)
            self._group.check(None)
            reshard(path, scratch, world, ctx=RunContext(group=self._group, overwrite=True))
            load_from = scratch
        try:
            loaded, client = engine_io.load(engine, load_from, step)
            if loaded is None:
                raise CkptkitError(f"{load_from}: DeepSpeed's load_checkpoint loaded nothing")
            from ..formats.deepspeed.reader import DS_KEYS, STRUCTURAL_KEYS

            # DeepSpeed hands back every entry it does not know as client state; keep the user's
            self.extra = {k: v for k, v in dict(client or {}).items() if k not in DS_KEYS and k not in STRUCTURAL_KEYS}
            saved = self.extra.pop(ENGINE_STATES, None) or {}
            _check_states(load_from, states, saved)
            for k, obj in states.items():
                obj.load_state_dict(saved[k])
        finally:
            if scratch is not None:
                self._group.check(None)  # every rank has read it before rank 0 removes it
                if self._group.is_root:
                    shutil.rmtree(scratch, ignore_errors=True)

    def _sweep_and_choose(self, step: int | None) -> tuple[Folder | None, list[Folder]]:
        """Rank 0 (one collective for both) cleans up after saves that were killed, then chooses
        the folder to restore. The sweep: for every step with leftovers (hidden temporaries, aside
        copies of a replaced step, locks) the output's own `recover` takes the step's lock when no
        live run holds it, removes the dead runs' leftovers, puts an aside copy back when a kill
        came between the two renames of an overwrite, and lets go."""
        self._sweep_here()
        return self._choose(step)

    def _sweep_here(self) -> None:
        try:
            listed = os.listdir(self.directory)
        except OSError:
            return
        targets = {m.group(1) or m.group(2) for n in listed if (m := LEFTOVER.fullmatch(n))}
        for target in sorted(targets):
            recover(os.path.join(self.directory, target))
        pointer.sweep(self.directory)


def _check_step(step: Any) -> None:
    """save, restore and path take the same steps: non-negative ints."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"step must be a non-negative int (got {step!r:.60})")


def _check_model(model: Any) -> None:
    """What save and restore take as `model` (docs/hooks.md): a torch module or a DeepSpeed engine."""
    if not (_is_engine(model) or isinstance(model, torch.nn.Module)):
        raise UsageError(
            f"model must be a torch.nn.Module (plain, DDP or FSDP2) or a DeepSpeed engine "
            f"(got {type(model).__name__}); a state dict is saved with ckptkit.save"
        )


def _make_folder(directory: str) -> None:
    """Create the Checkpointer's folder; a file in its place (or in its path) is named as such."""
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        what = (
            "is a file, not a folder"
            if os.path.isfile(directory)
            else "is not a folder"
            if os.path.lexists(directory)
            else "has a file where one of its parent folders should be"
        )
        raise OutputError(
            f"{directory}: {what}; the Checkpointer keeps its steps in a folder ({exc.strerror})"
        ) from None
    except OSError as exc:
        raise OutputError(f"{directory}: cannot create the checkpoint folder ({exc.strerror})") from None


def _remove(directory: str, name: str) -> None:
    """Delete a step folder: first renamed to a hidden temporary (gone from listings at once),
    then removed; a crash in between leaves a temporary the next restore sweeps."""
    hidden = os.path.join(directory, f".{name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        os.rename(os.path.join(directory, name), hidden)
    except OSError:
        return
    shutil.rmtree(hidden, ignore_errors=True)  # a real folder: examine() refuses links


def _warn_skipped(directory: str, found: Folder | None, skipped: list[Folder]) -> None:
    shown = "; ".join(f"{f.name} {f.why}" for f in skipped[:SHOWN])
    more = f"; and {len(skipped) - SHOWN} more" if len(skipped) > SHOWN else ""
    took = f"restoring step {found.step} from {found.name}" if found else "no complete checkpoint, a fresh start"
    warnings.warn(
        f"{directory}: skipped {len(skipped)} folder(s) named like steps that are not complete "
        f"checkpoints: {shown}{more}; {took}",
        SkippedStepsWarning,
        stacklevel=3,
    )


def _stage(obj: Any, reuse: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """A CPU copy of a state dict (DTensors stay DTensors over CPU copies of their shards; pinned
    memory when the source is on a GPU), so training can go on while the copy is written; and the
    copies made, in order. The k-th tensor is copied into `reuse[k]` (a previous save's staging,
    no longer read) when that has its shape, dtype and memory kind, else into new memory."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    cuda_seen = []
    old = list(reuse or ())
    made: list[torch.Tensor] = []

    def copy_tensor(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        k = len(made)
        prior = old[k] if k < len(old) else None
        pinned = t.is_cuda
        laid_out = prior is not None and (prior.is_contiguous() if pinned else prior.stride() == t.stride())
        if prior is not None and not (
            laid_out and prior.shape == t.shape and prior.dtype == t.dtype and prior.is_pinned() == pinned
        ):
            prior = None  # (laid out as the new memory would be: empty() for a GPU's, a clone of `t`)
        if t.is_cuda:
            cuda_seen.append(True)
            out = prior if prior is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            made.append(out.copy_(t, non_blocking=True))
        else:
            made.append(prior.copy_(t) if prior is not None else t.clone())
        return made[-1]

    def visit(v: Any) -> Any:
        if isinstance(v, DTensor):
            return DTensor.from_local(
                copy_tensor(v.to_local()),
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        if isinstance(v, torch.Tensor):
            return copy_tensor(v)
        if isinstance(v, dict):
            return {k: visit(x) for k, x in v.items()}
        if isinstance(v, list):
            return [visit(x) for x in v]
        if isinstance(v, tuple):
            return tuple(visit(x) for x in v)
        return copy.deepcopy(v)

    staged = visit(obj)
    if cuda_seen:
        torch.cuda.synchronize()
    return staged, made
