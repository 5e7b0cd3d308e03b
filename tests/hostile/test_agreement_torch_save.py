"""torch.save archives are read as torch.load(weights_only=True) reads them, or refused.

Crafted from plain_state_dict.pt: records that decide how torch reads the archive (byteorder,
version and .data/version, .storage_alignment, the folder every member must lie in, taken from
the first member) and persistent ids that name one storage key with two storage types or sizes
(torch builds the first and hands it to every later id of the key) or as bytes. Refusals go
through tests/helpers/hostile.py's whole contract and verify --deep must not say ok; what torch accepts
and ckptkit reads is compared with torch.load bit for bit.
"""

from __future__ import annotations

import dataclasses
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.agreement import PLAIN, assert_same, consolidated, needs, refused_everywhere

# ---- torch.save: records ---------------------------------------------------------------------


def _rezip(
    dst: Path,
    change: Callable[[str, bytes], bytes | None] = lambda n, d: d,
    first: tuple[tuple[str, bytes], ...] = (),
    last: tuple[tuple[str, bytes], ...] = (),
) -> Path:
    """A copy of plain_state_dict.pt, stored, each member passed through `change` (None drops
    it), with `first` members listed before and `last` after the fixture's."""
    needs(PLAIN)
    with zipfile.ZipFile(PLAIN) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for name, data in first:
            zout.writestr(name, data)
        for info in zin.infolist():
            data = change(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
        for name, data in last:
            zout.writestr(name, data)
    return dst


def _record(suffix: str, value: bytes | None) -> Callable[[str, bytes], bytes | None]:
    return lambda name, data: value if name.endswith("/" + suffix) else data


def _torch_reads(path: Path) -> dict | None:
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal of torch's counts as one
        return None


REFUSED_RECORDS = {
    # byteorder: torch byte-swaps every storage of a 'big' file, refuses any other word
    "byteorder_big": (_record("byteorder", b"big"), (), ()),
    "byteorder_big_newline": (_record("byteorder", b"big\n"), (), ()),
    "byteorder_upper_case": (_record("byteorder", b"LITTLE"), (), ()),
    "byteorder_empty": (_record("byteorder", b""), (), ()),
    # version (.data/version first): a number torch's zip reader supports, or refused
    "version_not_a_number": (_record("version", b"abc"), (), ()),
    "version_zero": (_record("version", b"0\n"), (), ()),
    "version_too_new": (_record("version", b"11\n"), (), ()),
    "version_missing": (_record("version", None), (), ()),
    "data_version_too_new": (lambda n, d: d, (), (("plain_state_dict/.data/version", b"99\n"),)),
    "storage_alignment_not_an_integer": (_record(".storage_alignment", b"sixty-four"), (), ()),
    # the archive's folder is the first member's, and holds every member
    "a_first_member_of_another_folder": (lambda n, d: d, (("other/readme", b"x"),), ()),
    "a_last_member_of_another_folder": (lambda n, d: d, (), (("other/readme", b"x"),)),
    "a_first_member_in_no_folder": (lambda n, d: d, (("byteorder", b"big"),), ()),
}


@pytest.mark.parametrize("case", sorted(REFUSED_RECORDS))
def test_torch_save_records_torch_reads_otherwise_are_refused(tmp_path, case):
    change, first, last = REFUSED_RECORDS[case]
    src = _rezip(tmp_path / "model.pt", change, first, last)
    truth = _torch_reads(src)
    if truth is not None:  # torch reads it: its values must then differ from the bytes ckptkit would copy
        assert case.startswith("byteorder_big")
        assert not torch.equal(truth["embed.weight"], torch.load(PLAIN, weights_only=True)["embed.weight"])
    refused_everywhere(src, tmp_path, str(src))


ACCEPTED_RECORDS = {
    "no_byteorder_record": _record("byteorder", None),  # torch's default: little
    "version_as_stoull_reads_it": _record("version", b" +10 trailing"),
    "version_without_newline": _record("version", b"3"),
    "storage_alignment_with_white_space": _record(".storage_alignment", b" 64\n"),
    "format_version_of_any_text": _record(".format_version", b"x"),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_RECORDS))
def test_torch_save_records_torch_accepts_read_as_torch_reads_them(tmp_path, case):
    src = _rezip(tmp_path / "model.pt", ACCEPTED_RECORDS[case])
    truth = torch.load(src, weights_only=True)
    assert_same(truth, consolidated(src, tmp_path))


def test_a_data_version_record_is_read_before_version(tmp_path):
    """torch reads .data/version when present: a bad `version` beside a good one is no refusal."""
    src = _rezip(tmp_path / "model.pt", _record("version", b"abc"), last=(("plain_state_dict/.data/version", b"3\n"),))
    truth = torch.load(src, weights_only=True)
    assert_same(truth, consolidated(src, tmp_path))


# ---- torch.save: persistent ids naming one storage ------------------------------------------


@dataclasses.dataclass
class _Pid:
    """One persistent id of data.pkl: each of its five fields' byte span and value."""

    spans: list[tuple[int, int]]
    values: list[object]


def _pids(data: bytes) -> list[_Pid]:
    """The persistent ids of a protocol-2 pickle torch.save wrote (a MARKed 5-tuple then BINPERSID)."""
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    memo: dict[int, object] = {}
    found: list[_Pid] = []
    last_value: object = None
    pending, pending_at, last_at = None, -1, -1
    stack: list[tuple[int, int, object]] = []
    for i, (op, arg, pos) in enumerate(ops):
        span = (pos, ends[i])
        if op.name in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = last_value
            continue
        if op.name == "MARK":
            stack.append((-1, -1, "MARK"))
            continue
        if op.name == "BINPERSID":  # (a shared storage's later ids are a BINGET of the first: not listed)
            if pending is not None and pending_at == last_at:
                found.append(pending)
            continue
        value: object = arg
        if op.name == "GLOBAL":
            value = ("global", arg)
        elif op.name in ("BINGET", "LONG_BINGET"):
            value = memo.get(arg)
        if op.name == "TUPLE":
            items = []
            while stack and stack[-1][2] != "MARK":
                items.append(stack.pop())
            if stack:
                stack.pop()
            items.reverse()
            if len(items) == 5 and items[0][2] == "storage":
                pending, pending_at = _Pid([(a, b) for a, b, _ in items], [v for _, _, v in items]), i
            value = ("tuple",)
        stack.append((span[0], span[1], value))
        last_value, last_at = value, i
    return found


def _splice(data: bytes, edits: dict[tuple[int, int], bytes]) -> bytes:
    out, pos = [], 0
    for (a, b), new in sorted(edits.items()):
        out += [data[pos:a], new]
        pos = b
    return b"".join(out + [data[pos:]])


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _global(name: str) -> bytes:
    return b"c" + name.replace(" ", "\n").encode() + b"\n"


def _with_pickle(tmp: Path, mutate: Callable[[bytes, list[_Pid]], bytes]) -> Path:
    needs(PLAIN)
    with zipfile.ZipFile(PLAIN) as z:
        data = z.read("plain_state_dict/data.pkl")
    new = mutate(data, _pids(data))
    return _rezip(tmp / "model.pt", lambda n, d: new if n.endswith("/data.pkl") else d)


def _storage(pid: _Pid) -> tuple[str, str, int]:
    kind = pid.values[1]
    return kind[1] if isinstance(kind, tuple) else "?", pid.values[2], pid.values[4]


def _pair(pids: list[_Pid], same_bytes: bool, other_type: bool) -> tuple[_Pid, _Pid]:
    """Two persistent ids of the fixture: the first with a storage of more than 0 bytes."""
    size = {
        "torch FloatStorage": 4,
        "torch HalfStorage": 2,
        "torch BFloat16Storage": 2,
        "torch LongStorage": 8,
        "torch IntStorage": 4,
        "torch BoolStorage": 1,
        "torch DoubleStorage": 8,
    }
    for a in pids:
        ta, _, na = _storage(a)
        for b in pids[pids.index(a) + 1 :]:
            tb, _, nb = _storage(b)
            if ta not in size or tb not in size or not na or a.values[2] == b.values[2]:
                continue
            if other_type == (ta != tb) and same_bytes == (na * size[ta] == nb * size[tb]):
                return a, b
    pytest.skip("the fixture has no such pair of storages")


def test_the_fixtures_persistent_ids_are_found():
    """The pickle walk the attacks below rely on sees every storage of the fixture."""
    needs(PLAIN)
    with zipfile.ZipFile(PLAIN) as z:
        pids = _pids(z.read("plain_state_dict/data.pkl"))
        members = [n for n in z.namelist() if "/data/" in n]
    keys = [p.values[2] for p in pids]  # (a storage two tensors share is named twice: tied weights)
    assert sorted(set(keys)) == sorted(n.rsplit("/", 1)[1] for n in members) and len(keys) > len(set(keys))


def _same_key(other_type: bool, same_bytes: bool, first_changes: bool = False):
    def mutate(data: bytes, pids: list[_Pid]) -> bytes:
        a, b = _pair(pids, same_bytes, other_type)
        if first_changes:  # the later id keeps its key; the earlier one is renamed to it
            return _splice(data, {a.spans[2]: _text(b.values[2])})
        return _splice(data, {b.spans[2]: _text(a.values[2])})

    return mutate


def _retyped(storage_type: str, numel_of_first: bool = True):
    """The second storage named by the first's key and element count, as another type."""

    def mutate(data: bytes, pids: list[_Pid]) -> bytes:
        a, b = pids[0], pids[1]
        edits = {b.spans[1]: _global(storage_type), b.spans[2]: _text(a.values[2])}
        if numel_of_first:
            edits[b.spans[4]] = b"J" + struct.pack("<i", a.values[4])
        return _splice(data, edits)

    return mutate


def _bytes_key(data: bytes, pids: list[_Pid]) -> bytes:
    key = pids[0].values[2].encode()
    return _splice(data, {pids[0].spans[2]: b"C" + bytes([len(key)]) + key})


PID_ATTACKS = {
    "other_type_same_bytes": _same_key(other_type=True, same_bytes=True),
    "other_type_other_bytes": _same_key(other_type=True, same_bytes=False),
    "same_type_other_size": _same_key(other_type=False, same_bytes=False),
    "other_type_earlier_id_renamed": _same_key(other_type=True, same_bytes=False, first_changes=True),
    "float_then_half": _retyped("torch HalfStorage"),
    "float_then_int": _retyped("torch IntStorage"),
    "float_then_untyped": _retyped("torch UntypedStorage", numel_of_first=False),
    "key_as_bytes": _bytes_key,
}


@pytest.mark.parametrize("case", sorted(PID_ATTACKS))
def test_two_persistent_ids_giving_one_storage_two_meanings_are_refused(tmp_path, case):
    src = _with_pickle(tmp_path, PID_ATTACKS[case])
    refused_everywhere(src, tmp_path, str(src))


def test_a_storage_shared_as_torch_save_shares_it_is_read_as_torch_reads_it(tmp_path):
    """Two ids of one key with the same type and size (torch.save's own sharing) stay accepted."""

    def share(data: bytes, pids: list[_Pid]) -> bytes:
        a, b = _pair(pids, same_bytes=True, other_type=False)
        return _splice(data, {b.spans[2]: _text(a.values[2])})

    src = _with_pickle(tmp_path, share)
    truth = torch.load(src, weights_only=True)
    assert_same(truth, consolidated(src, tmp_path))
