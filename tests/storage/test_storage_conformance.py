"""The storage contract in one place: every source and every output passes the same tests.

As fsspec's backends inherit its abstract test classes, each implementation here is a small
subclass that says where its files live; the tests themselves are written once:

- `SourceConformance`: byte ranges, sizes, listings, folders, and the sentences for a missing
  path, a missing file, a damaged offset and a truncated file. Local folders (plain, `file://`
  and `local://`) and `memory://` through fsspec.
- `OutputConformance`: the commit protocol (storage/commit.py) behind `open_output`. Files read
  back through the source API once committed; nothing looks finished before the commit (what a
  reader takes as finished: formats/registry.py `_refuse_unfinished`); an error or a Ctrl-C
  aborts and leaves nothing that looks valid; an existing OUT is refused without `--overwrite`
  and replaced with it. `RenameOutput` (a local folder), `RenameFileOutput` (one local file),
  and `MarkerOutput` on `memory://` and on S3 (moto, slow).

Scenarios that belong to one implementation stay with it: locks, sweeps, symlinks and swaps in
test_output_paths_and_locks.py, SIGKILL in test_crash.py, whole commands against S3 in test_remote.py.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from ckptkit import interrupts
from ckptkit.errors import FormatError, NotACheckpointError, OutputError
from ckptkit.formats.registry import _refuse_unfinished
from ckptkit.storage.commit import OutputCommit
from ckptkit.storage.output import open_output
from ckptkit.storage.remote_output import MarkerOutput
from ckptkit.storage.rename_output import RenameFileOutput, RenameOutput
from ckptkit.storage.source import RangeFile, Source, open_source
from conftest import free_port

DATA = bytes(range(256)) * 40  # 10 KiB, every byte value, so a wrong offset shows
FILES = {"a.bin": DATA, "sub/b.bin": DATA[::-1], "sub/deeper/c.txt": b"tiny"}
SMALL = {"meta.json": b'{"step": 1}'}  # written with write_bytes: a small file, from rank 0
EXISTING = "existing.txt"  # what an earlier run left at OUT


def looks_finished(path: str) -> bool:
    """Whether ckptkit's readers would take `path` as a finished checkpoint location."""
    try:
        source = open_source(path)
        _refuse_unfinished(path, source)
    except NotACheckpointError:
        return False
    return True


# ---- sources -------------------------------------------------------------------------------------


class SourceConformance:
    """Every Source reads what `make` stored, by exact byte range, and says what is wrong in one
    sentence naming the file."""

    def make(self, files: dict[str, bytes]) -> str:
        """A checkpoint location holding `files`; returns the path or URL to open."""
        raise NotImplementedError

    @pytest.fixture()
    def source(self) -> Source:
        return open_source(self.make(FILES))

    def test_byte_ranges(self, source: Source) -> None:
        for rel, data in FILES.items():
            assert source.size(rel) == len(data)
            assert source.read(rel, 0, len(data)) == data
            assert source.read(rel, 1, len(data) - 2) == data[1:-1]
            assert source.read(rel, len(data), 0) == b""
            buf = bytearray(3)
            source.readinto(rel, len(data) - 3, memoryview(buf))
            assert bytes(buf) == data[-3:]

    def test_a_range_file_reads_its_window(self, source: Source) -> None:
        window = RangeFile(source, "a.bin", 1000, 600)
        assert window.read(10) == DATA[1000:1010]
        window.seek(-5, 2)
        assert window.read() == DATA[1595:1600]

    def test_listing_and_folders(self, source: Source) -> None:
        assert source.listdir("") == ["a.bin", "sub"]
        assert source.listdir("sub") == ["b.bin", "deeper"]
        assert source.isdir("") and source.isdir("sub") and not source.isdir("a.bin")
        assert source.exists("sub/deeper/c.txt") and not source.exists("sub/none")

    @pytest.mark.parametrize("how", ["size", "read", "readinto"])
    def test_a_missing_file_is_one_sentence(self, source: Source, how: str) -> None:
        calls = {
            "size": lambda: source.size("sub/none.bin"),
            "read": lambda: source.read("sub/none.bin", 0, 4),
            "readinto": lambda: source.readinto("sub/none.bin", 0, memoryview(bytearray(4))),
        }
        with pytest.raises(FormatError) as err:
            calls[how]()
        assert str(err.value).startswith(source.label("sub/none.bin") + ": ")
        assert "file is missing" in str(err.value)

    def test_a_damaged_offset_and_a_truncated_file(self, source: Source) -> None:
        with pytest.raises(FormatError, match="the metadata that points there is damaged"):
            source.read("a.bin", -1, 4)
        with pytest.raises(FormatError, match=r"\(truncated\?\)") as err:
            source.read("a.bin", len(DATA) - 2, 4)
        assert str(err.value).startswith(source.label("a.bin"))

    def test_a_missing_location(self) -> None:
        missing = self.make(FILES) + "-none"
        with pytest.raises(NotACheckpointError, match=r"^.*-none: no such file or folder$"):
            open_source(missing)


def _write_local(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


class TestLocalSource(SourceConformance):
    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> None:
        self.root = tmp_path / "ckpt"

    def make(self, files: dict[str, bytes]) -> str:
        _write_local(self.root, files)
        return str(self.root)


class TestFileUrlSource(TestLocalSource):
    def make(self, files: dict[str, bytes]) -> str:
        return "file://" + super().make(files)


class TestLocalUrlSource(TestLocalSource):
    """fsspec's local:// names the local filesystem: read as a local path, with its checks."""

    def make(self, files: dict[str, bytes]) -> str:
        return "local://" + super().make(files)


@pytest.fixture()
def memory_root():
    """A fresh memory:// bucket, removed afterwards (the memory filesystem is process-wide)."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    bucket = f"conformance-{uuid.uuid4().hex[:8]}"
    yield fs, bucket
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


class TestMemorySource(SourceConformance):
    @pytest.fixture(autouse=True)
    def _where(self, memory_root) -> None:
        self.fs, self.bucket = memory_root

    def make(self, files: dict[str, bytes]) -> str:
        for rel, data in files.items():
            self.fs.pipe_file(f"/{self.bucket}/ckpt/{rel}", data)
        return f"memory://{self.bucket}/ckpt"


# ---- outputs -------------------------------------------------------------------------------------


class OutputConformance:
    """Every output commits all of its files at once or none of them. A subclass says where OUT
    is and how to look at what is there; `kind` is the implementation open_output must choose."""

    kind: type
    single_file = False
    empty_folder_is_free = True  # an empty folder at OUT is taken without --overwrite
    failed_overwrite_keeps_old = True  # a rename never touches OUT before the commit

    out: str

    def put_existing(self) -> None:
        """Put an earlier output at OUT, holding EXISTING."""
        raise NotImplementedError

    def put_empty_folder(self) -> None:
        raise NotImplementedError

    def at_out(self) -> list[str]:
        """What is at OUT (names of its files, relative), [] when nothing is."""
        raise NotImplementedError

    def leftovers(self) -> list[str]:
        """What lies next to OUT that the run made (temporaries, locks); [] when clean."""
        raise NotImplementedError

    def read_back(self) -> Source:
        """OUT opened as a source, in which `files()`' paths are found."""
        return open_source(self.out)

    def files(self) -> dict[str, bytes]:
        return {**FILES, **SMALL}

    def open(self, overwrite: bool = False) -> OutputCommit:
        return open_output(self.out, overwrite=overwrite, single_file=self.single_file)

    def write(self, output: OutputCommit) -> None:
        for rel, data in self.files().items():
            if rel in SMALL:
                output.write_bytes(rel, data)
                continue
            with output.open(rel) as f:
                f.write(data)

    def check_committed(self) -> None:
        assert looks_finished(self.out)
        source = self.read_back()
        for rel, data in self.files().items():
            assert source.size(rel) == len(data)
            assert source.read(rel, 0, len(data)) == data
            assert source.read(rel, 1, len(data) - 2) == data[1:-1]
        assert self.leftovers() == []

    def check_nothing_valid(self) -> None:
        assert not looks_finished(self.out)
        assert self.at_out() == [] and self.leftovers() == []

    def test_the_factory_chooses_this_kind(self) -> None:
        assert type(self.open()) is self.kind

    def test_committed_files_read_back(self) -> None:
        with self.open() as output:
            self.write(output)
        self.check_committed()

    def test_nothing_looks_finished_before_the_commit(self) -> None:
        with self.open() as output:
            self.write(output)
            assert not looks_finished(self.out)
        self.check_committed()

    def test_an_error_aborts_and_leaves_nothing_valid(self) -> None:
        with pytest.raises(RuntimeError, match="the writer failed"):
            with self.open() as output:
                self.write(output)
                raise RuntimeError("the writer failed")
        self.check_nothing_valid()

    def test_a_file_whose_writer_failed_aborts_it_all(self) -> None:
        rel = next(iter(self.files()))
        with pytest.raises(RuntimeError):
            with self.open() as output:
                with output.open(rel) as f:
                    f.write(b"half")
                    raise RuntimeError("the writer failed")
        self.check_nothing_valid()

    def test_ctrl_c_abandons_instead_of_committing(self) -> None:
        try:
            with pytest.raises(interrupts.Cancelled):
                with self.open() as output:
                    self.write(output)
                    assert interrupts.cleanup_pending()
                    interrupts.cancel()  # what the CLI's handler does on Ctrl-C while an output is open
            assert not interrupts.cleanup_pending()
        finally:
            interrupts.reset()
        self.check_nothing_valid()

    def test_an_existing_out_is_refused_without_overwrite(self) -> None:
        self.put_existing()
        before = self.at_out()
        with pytest.raises(OutputError) as err:
            with self.open() as output:
                self.write(output)
        assert str(err.value) == f"{self.out}: output already exists (choose another path or pass --overwrite)"
        assert self.at_out() == before and self.leftovers() == []

    def test_overwrite_replaces_the_old_output(self) -> None:
        self.put_existing()
        with self.open(overwrite=True) as output:
            self.write(output)
        self.check_committed()
        assert EXISTING not in self.at_out()

    def test_a_failed_overwrite(self) -> None:
        self.put_existing()
        before = self.at_out()
        with pytest.raises(RuntimeError):
            with self.open(overwrite=True) as output:
                self.write(output)
                raise RuntimeError("the writer failed")
        if self.failed_overwrite_keeps_old:
            assert self.at_out() == before and self.leftovers() == []
        else:  # the old output was removed to make room: what is left must not look valid
            self.check_nothing_valid()

    def test_an_empty_folder_at_out(self) -> None:
        self.put_empty_folder()
        if not self.empty_folder_is_free:
            with pytest.raises(OutputError, match="already exists"):
                with self.open():
                    pass
            return
        with self.open() as output:
            self.write(output)
        self.check_committed()


class LocalOutput(OutputConformance):
    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path) -> None:
        self.parent = tmp_path / "work"
        self.parent.mkdir()
        self.out = str(self.parent / self.name)

    name = "OUT"

    def at_out(self) -> list[str]:
        path = Path(self.out)
        if path.is_file():
            return [path.name]
        if not path.is_dir():
            return []
        return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())

    def leftovers(self) -> list[str]:
        return sorted(n for n in os.listdir(self.parent) if n != self.name)

    def put_empty_folder(self) -> None:
        os.mkdir(self.out)


class TestRenameOutput(LocalOutput):
    kind = RenameOutput

    def put_existing(self) -> None:
        _write_local(Path(self.out), {EXISTING: b"old"})


class TestRenameFileOutput(LocalOutput):
    kind = RenameFileOutput
    single_file = True
    empty_folder_is_free = False
    name = "model.pt"

    def files(self) -> dict[str, bytes]:
        return {self.name: DATA}

    def read_back(self) -> Source:
        return open_source(str(self.parent), only=self.name)

    def put_existing(self) -> None:
        Path(self.out).write_bytes(b"old")

    def at_out(self) -> list[str]:
        path = Path(self.out)
        if path.is_file():
            return [EXISTING] if path.read_bytes() == b"old" else [self.name]
        return super().at_out()

    def test_a_remote_single_file_is_refused(self) -> None:
        with pytest.raises(OutputError, match="a single-file output must be a local path"):
            open_output("memory://bucket/model.pt", single_file=True)


class RemoteOutput(OutputConformance):
    kind = MarkerOutput
    failed_overwrite_keeps_old = False  # object stores cannot swap: OUT is emptied at the start

    fs: object
    base: str

    def put_existing(self) -> None:
        self.fs.pipe_file(f"{self.base}/{EXISTING}", b"old")

    def put_empty_folder(self) -> None:
        self.fs.mkdir(self.base)

    def at_out(self) -> list[str]:
        self.fs.invalidate_cache()  # look at the store, not at what this client listed before
        if not self.fs.exists(self.base):
            return []
        return sorted(p[len(self.base) + 1 :] for p in self.fs.find(self.base))

    def leftovers(self) -> list[str]:
        return []  # a marker output writes inside OUT only

    def test_the_markers(self) -> None:
        with self.open() as output:
            self.write(output)
            assert ".ckptkit-incomplete" in self.at_out()
        assert ".ckptkit-incomplete" not in self.at_out()
        assert sorted(self.at_out()) == sorted([*self.files(), ".ckptkit-complete"])


class TestMarkerOutputInMemory(RemoteOutput):
    @pytest.fixture(autouse=True)
    def _where(self, memory_root) -> None:
        self.fs, bucket = memory_root
        self.base = f"/{bucket}/OUT"
        self.out = f"memory://{bucket}/OUT"


S3_BUCKET = "conformance"


@pytest.fixture(scope="module")
def s3_store():
    """A moto S3 server on loopback (as in test_remote.py) and an S3 filesystem on it. moto keeps
    its buckets per process, so the bucket's name is this module's own."""
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (pip install -e '.[dev]')")
    s3fs = pytest.importorskip("s3fs", reason="needs s3fs (pip install -e '.[dev]')")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint)
    fs.mkdir(S3_BUCKET, exist_ok=True)
    yield fs, endpoint
    server.stop()


@pytest.mark.slow
class TestMarkerOutputOnS3(RemoteOutput):
    @pytest.fixture(autouse=True)
    def _where(self, s3_store, monkeypatch):
        import fsspec

        self.fs, endpoint = s3_store
        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
        name = f"out-{uuid.uuid4().hex[:8]}"
        self.base = f"{S3_BUCKET}/{name}"
        self.out = f"s3://{S3_BUCKET}/{name}"
        yield
        self.fs.invalidate_cache()
        if self.fs.exists(self.base):
            self.fs.rm(self.base, recursive=True)
