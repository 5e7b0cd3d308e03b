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

This module is the protocol (folders, marker, pointer, one decision by rank 0 for every rank);
which folders count, which one to restore and which to keep are policy.py's, what goes into a
folder per kind of model backends.py's, and async saves' CPU copies and thread staging.py's.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Callable

from ..errors import CkptkitError, FormatError, OutputError, UsageError
from ..runner.distributed import Group, PeerError, group_of
from ..storage.output import open_output
from ..storage.source import is_url, path_text
from . import backends, pointer, policy, rng, step_guard
from . import steps as step_folders
from .backends import check_model, is_engine
from .rng import RngNotRestoredWarning  # noqa: F401  (re-exported: restore warns with it)
from .saved import STATES, rank_key
from .staging import BackgroundSave, prepare
from .steps import Folder
from .states import check_states, state_dicts, validate as validate_states

SHOWN = 10  # skipped folders named in the warning


class SkippedStepsWarning(UserWarning):
    """restore() passed over folders named like steps that are not complete checkpoints."""


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
        self._background = BackgroundSave()
        self._guarded: weakref.WeakSet = weakref.WeakSet()  # optimizers whose step waits for a save's copy
        self._bg_pg: Any = None
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
        return policy.complete_steps(self.directory)

    def path(self, step: int) -> str:
        """The folder of `step`'s complete checkpoint, whichever spelling; where save(step) would
        write it when there is none."""
        _check_step(step)
        names = step_folders.scan(self.directory).get(step, [])
        found = policy.complete_folder(self.directory, step, names)
        return os.path.join(self.directory, found.name if found else step_folders.default_name(step))

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
        """Collective. Save `step`. With async_save return at once: the optimizer's tensors are
        copied to CPU on a background thread (optimizer.step() waits for that copy), the rest
        before returning, and the copy is written in the background (docs/hooks.md). `states`
        maps names to objects with state_dict()/load_state_dict() (a scheduler, a dataloader),
        each rank's saved apart. Anything already at `step` (a checkpoint or a stray) is
        replaced only with `overwrite`."""
        self._background.raise_error()
        self.wait()
        _check_step(step)
        check_model(model)
        engine = is_engine(model)
        if engine and optimizer is not None and extra is None and isinstance(optimizer, dict):
            extra, optimizer = optimizer, None
        if extra is not None and not isinstance(extra, dict):
            raise UsageError(f"extra must be a dict of name -> value, or None (got {type(extra).__name__})")
        saved_states = state_dicts(states)
        # checked before anything is written: a step restore would refuse is never committed
        if engine:
            backends.agree_restorable(
                self._group, {"extra": extra or {}, STATES: {rank_key(self._group.rank): saved_states}}, dcp=False
            )
        else:
            state = backends.torch_state(self._group, step, model, optimizer, extra, saved_states)
        name = self._on_root(lambda: policy.target_name(self.directory, step, overwrite))
        rng_doc = rng.capture(self._group.world, self._group.rank) if self.rng else None
        if engine:
            self._save_engine(step, name, model, extra, saved_states, rng_doc, overwrite)
            return
        if not self.async_save:
            self._write(step, name, overwrite, state, rng_doc, self._group, None)
            return
        owned = step_guard.guard(optimizer, self._background, self._guarded)  # copied later, before its step
        staging = prepare(state, owned, self._background.buffers)
        self._background.buffers = staging.buffers
        group = group_of(self._bg_pg) if self._bg_pg is not None else self._group

        def write(staged: dict, failure: BaseException | None) -> None:
            group.check(failure)  # a copy that failed on any rank: no rank writes anything
            self._write(step, name, overwrite, staged, rng_doc, group, self._bg_pg)

        self._background.start(f"ckptkit-save-{step}", staging.finish, write)

    def wait_staged(self) -> None:
        """Return once the async save in flight has made its CPU copy: from then on the saved
        tensors may change in any way (optimizer.step() waits for this by itself)."""
        self._background.wait_staged()

    def wait(self) -> None:
        """Join a background save (its failure is raised here, or by the next call)."""
        self._background.wait()

    def _write(
        self, step: int, name: str, overwrite: bool, state: dict, rng_doc: dict | None, group: Group, pg: Any
    ) -> None:
        with open_output(os.path.join(self.directory, name), overwrite=overwrite, group=group) as out:
            backends.write_torch(state, out.tmp, pg)  # `group` is group_of(pg)
            if rng_doc is not None:
                rng.write(out.tmp, rng_doc)
            self._mark(out.tmp, step, "dcp", group)
        self._retain(group, step)

    def _save_engine(
        self, step: int, name: str, engine: Any, extra: dict | None, states: dict, rng_doc: dict | None, overwrite: bool
    ) -> None:
        with open_output(os.path.join(self.directory, name), overwrite=overwrite, group=self._group) as out:
            backends.save_engine(engine, out.tmp, step, extra, states)
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
        """Rank 0 applies the keep policy (policy.decide_retention: the newest `keep` complete
        steps and `written` kept; of the others only folders ckptkit's marker proves complete are
        marked), then deletes exactly the marked folders. Strays, user files and folders from
        before markers are never touched. A folder is renamed to a hidden temporary before it is
        removed, so a crash half-way leaves something the next restore sweeps, not a torso.
        Last, the pointer file names the newest complete step."""
        if not group.is_root:
            return
        decided = policy.retention(self.directory, self.keep, written)
        for name in decided.delete:
            policy.remove_step_folder(self.directory, name)
        if decided.newest:
            try:
                pointer.write(self.directory, decided.newest)
            except OSError as exc:  # the step is saved; restore never needs the pointer
                warnings.warn(
                    f"{self.directory}: could not update {pointer.NAME} to {decided.newest} "
                    f"({exc.strerror}); restore lists the folder instead",
                    stacklevel=4,
                )

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
        check_model(model)
        validate_states(states or {})  # a fresh start too: the next save would refuse them
        found, skipped = self._on_root(lambda: self._sweep_and_choose(step))
        if skipped and self._group.is_root:
            _warn_skipped(self.directory, found, skipped)
        if found is None:
            self.extra = None
            return None
        path = os.path.join(self.directory, found.name)
        rng_doc, rng_why = self._read_rng(path) if self.rng else (None, None)  # refused before anything loads
        if is_engine(model):
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
        self.extra = backends.restore_torch(path, model, optimizer, states, self._group.rank)

    def _restore_engine(self, step: int, path: str, engine: Any, states: dict[str, Any]) -> None:
        load_from, scratch = backends.engine_source(self.directory, step, path, engine, self._group)
        try:
            self.extra, saved = backends.load_engine(engine, load_from, step)
            check_states(load_from, states, saved)
            for k, obj in states.items():
                obj.load_state_dict(saved[k])
        finally:
            backends.release_scratch(scratch, self._group)

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

    def _sweep_and_choose(self, step: int | None) -> tuple[Folder | None, list[Folder]]:
        """Rank 0 (one collective for both) cleans up after saves that were killed (policy.sweep),
        then chooses the folder to restore (policy.choose)."""
        policy.sweep(self.directory)
        return policy.choose(self.directory, step)


def _check_step(step: Any) -> None:
    """save, restore and path take the same steps: non-negative ints."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"step must be a non-negative int (got {step!r:.60})")


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
