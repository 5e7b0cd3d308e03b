"""Opening an output: the one place that chooses how it will commit.

A local path is built in a temporary sibling and renamed into place (storage/rename_output.py);
a URL of an object store, which cannot rename a folder, commits by a marker written last
(storage/remote_output.py). Both follow storage/commit.py's `OutputCommit` protocol, so every
writer and operation sees the same object whichever it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import OutputError
from .commit import OutputCommit
from .remote_output import MarkerOutput
from .rename_output import RenameFileOutput, RenameOutput
from .source import is_url

if TYPE_CHECKING:
    from ..runner.distributed import Group


def open_output(
    path: str,
    *,
    overwrite: bool = False,
    group: Group | None = None,
    sources: Sequence[str | None] = (),
    single_file: bool = False,
) -> OutputCommit:
    """The output at `path` (a folder, or with `single_file` one file), to use as `with
    open_output(...) as out:`. `sources` are the paths the run reads: OUT may overlap none of
    them. `group` is the distributed job's (default: this process alone)."""
    from ..runner.distributed import LOCAL  # outputs are the one storage object in collectives

    group = group or LOCAL
    if single_file:
        if is_url(path):
            raise OutputError(
                f"{path}: a single-file output must be a local path; give a folder as OUT for remote storage"
            )
        return RenameFileOutput(path, overwrite=overwrite, group=group, sources=sources)
    if is_url(path):
        return MarkerOutput(path, overwrite=overwrite, group=group, sources=sources)
    return RenameOutput(path, overwrite=overwrite, group=group, sources=sources)
