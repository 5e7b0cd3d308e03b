"""Files a DeepSpeed writer would write alike are assembled once (tag_writer._alike).

ZeRO-3 writes a model-states file per rank that is the same on every rank but the first (its
tied params): a placeholder tensor per parameter, the shapes, the buffers. write_tag groups the
structures that are dicts holding the very same objects (same keys, same order, same fetcher),
builds their small archive once and writes it under each name. What must hold: every file is
byte for byte what write_archive writes for it alone, structures that merely look equal are not
grouped, and the progress still counts every file's tensor bytes.
"""

from __future__ import annotations

import copy
import threading

from ckptkit.context import RunContext
from ckptkit.formats.deepspeed.tag_writer import _alike, structure_bytes, write_tag
from ckptkit.formats.deepspeed.templates import lazify
from ckptkit.formats.registry import open_checkpoint
from ckptkit.formats.torch_save.archive_writer import write_archive
from ckptkit.runner.fetch import Fetcher
from ckptkit.storage.output import open_output
from conftest import DATA

SOURCE = DATA / "deepspeed" / "z3_bf16_w2"


class Counting:
    def __init__(self) -> None:
        self.done = 0
        self._lock = threading.Lock()

    def start(self, total: int, desc: str) -> None:
        pass

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n

    def retotal(self, total: int) -> None:
        pass

    def close(self) -> None:
        pass


def _model_states():
    """Rank 0's model-states structure of a real ZeRO-3 checkpoint (buffers: tensors with bytes),
    lazified as the writer does, and the fetcher its tensors read through."""
    opened = open_checkpoint(str(SOURCE))
    info = opened.index.native.cell()
    rel = info.files.prefix + info.files.model_files[0]
    return lazify(info.model_states[0], info.archives[rel], {}), Fetcher(opened.source), opened


def test_only_dicts_of_the_very_same_objects_are_grouped() -> None:
    base, fetcher, _ = _model_states()
    twin = copy.copy(base)  # the same objects: alike
    lookalike = copy.deepcopy(base)  # equal, but other objects: not grouped
    other_value = copy.copy(base)
    other_value["dp_world_size"] = 99
    other_fetcher = Fetcher(fetcher.source)
    groups = _alike(
        {
            "a": (base, fetcher),
            "b": (lookalike, fetcher),
            "c": (twin, fetcher),
            "d": (other_value, fetcher),
            "e": (twin, other_fetcher),
            "f": ([1], fetcher),
            "g": ([1], fetcher),
        }
    )
    assert groups == [["a", "c"], ["b"], ["d"], ["e"], ["f"], ["g"]]


def test_files_written_alike_are_each_what_write_archive_writes(tmp_path) -> None:
    base, fetcher, opened = _model_states()
    assert structure_bytes(base) > 0  # buffers: the shared archive reads tensor bytes
    structures = {f"tag/rank_{r}.pt": (copy.copy(base), fetcher) for r in range(3)}
    odd = copy.copy(base)
    odd["dp_world_size"] = 3
    structures["tag/odd.pt"] = (odd, fetcher)
    progress = Counting()
    with open_output(str(tmp_path / "alike")) as out:
        write_tag(out, opened.source, "tag", structures, RunContext(progress=progress, workers=2))
    with open_output(str(tmp_path / "alone")) as out:
        for name, (structure, f) in structures.items():
            write_archive(out, name, structure, f, slab_bytes=1 << 20)
    for name in structures:
        assert (tmp_path / "alike" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes(), name
    assert (tmp_path / "alike" / "tag/rank_0.pt").read_bytes() == (tmp_path / "alike" / "tag/rank_2.pt").read_bytes()
    assert progress.done == sum(structure_bytes(s) for s, _ in structures.values())
