"""A distributed output whose start fails after rank 0 took OUT's lock and made its temporary folder
(a peer that crashed or was stopped by Ctrl-C in one of the start's collectives) leaves nothing
next to OUT: no `with` block runs, so no __exit__ would remove them. The collectives are played by a
Group whose Nth collective fails, as a real job's does when the peer has gone."""

from __future__ import annotations

import os

import pytest

from ckptkit import interrupts
from ckptkit.runner.distributed import Group, PeerError
from ckptkit.storage.rename_output import RenameFileOutput, RenameOutput

# the start's collectives, in order: on_root's check (after rank 0's lock and folder), the share of
# the folder's name, the check that every rank sees it
COLLECTIVES = ["check after rank 0 started", "share of the folder", "check every rank sees it"]


class PeerGoneAt(Group):
    """Rank 0 of a two-process job whose `failing`th collective raises `error`."""

    def __init__(self, failing: int, error: BaseException) -> None:
        super().__init__(rank=0, world=2)
        self.calls, self.failing, self.error = 0, failing, error

    def _next(self) -> None:
        self.calls += 1
        if self.calls == self.failing:
            raise self.error

    def check(self, error: BaseException | None) -> None:
        if error is not None:
            raise error
        self._next()

    def share(self, obj):
        self._next()
        return obj


@pytest.mark.parametrize("output", [RenameOutput, RenameFileOutput])
@pytest.mark.parametrize("failing", range(1, len(COLLECTIVES) + 1), ids=COLLECTIVES)
@pytest.mark.parametrize(
    "error", [PeerError("the peer stopped answering"), interrupts.Cancelled()], ids=["peer", "ctrl-c"]
)
def test_a_start_that_fails_in_a_collective_leaves_nothing(tmp_path, output, failing, error):
    out = tmp_path / "out"
    group = PeerGoneAt(failing, error)
    with pytest.raises(type(error)):
        with output(str(out), overwrite=False, group=group, sources=()):
            pytest.fail("the with block ran although the start failed")
    assert group.calls == failing  # rank 0 had taken the lock and made its folder when it failed
    assert os.listdir(tmp_path) == []  # no lock, no temporary folder, no OUT


def test_a_start_that_succeeds_holds_the_lock_until_the_output_ends(tmp_path):
    """The counterpart: the same job with no failure keeps its lock and folder while writing."""
    out = tmp_path / "out"

    class Fine(PeerGoneAt):
        def check(self, error: BaseException | None) -> None:
            if error is not None:
                raise error

    with RenameOutput(str(out), overwrite=False, group=Fine(0, PeerError("unused")), sources=()) as target:
        held = sorted(os.listdir(tmp_path))
        assert held == [".out.ckptkit-lock", os.path.basename(target.tmp)]
        target.write_bytes("a.bin", b"x")
    assert sorted(os.listdir(tmp_path)) == ["out"]
