"""The oracle's operators on torch.save archives: records of the `data.pkl` pickle (persistent ids,
int and string arguments, dict entries) and of the zip (byteorder and version members, members
dropped, doubled, renamed, reordered, local headers that disagree with the central directory).

Each operator takes a seeded Random and the archive's members and returns (members, what it did),
or None where the archive offers nothing to mutate that way.
"""

from __future__ import annotations

import random
from dataclasses import replace

from helpers import oracle_pickle as P
from helpers.oracle_zip import Member, find, with_data

Result = "tuple[list[Member], str] | None"


def _pickle(members: list[Member]) -> tuple[int, list]:
    i = find(members, "data.pkl")
    return i, P.parse(members[i].data)


def _with_pickle(members: list[Member], i: int, ops: list) -> list[Member]:
    return with_data(members, i, P.encode(ops))


def storage_type(rng: random.Random, members: list[Member]) -> Result:
    i, ops = _pickle(members)
    pid = rng.choice(P.persid_ops(ops))
    new = rng.choice([t for t in P.STORAGE_TYPES if t != pid["type_name"]])
    return (
        _with_pickle(members, i, P.set_storage_type(ops, pid, new)),
        f"storage {pid['key_name']!r}: type {pid['type_name']} -> {new}",
    )


def storage_key_two_types(rng: random.Random, members: list[Member]) -> Result:
    """Two persistent ids name one storage key with two storage types."""
    i, ops = _pickle(members)
    pids = P.persid_ops(ops)
    pairs = [(a, b) for a in pids for b in pids if a["type_name"] != b["type_name"]]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    ops = P.replace_push(ops, b["key"], P.str_op(a["key_name"]))
    return (
        _with_pickle(members, i, ops),
        f"storage key {b['key_name']!r} ({b['type_name']}) -> {a['key_name']!r}, "
        f"the key of a {a['type_name']}: one key, two storage types",
    )


def storage_key(rng: random.Random, members: list[Member]) -> Result:
    """A persistent id names another storage of the same type (or a key no record has)."""
    i, ops = _pickle(members)
    pids = P.persid_ops(ops)
    b = rng.choice(pids)
    same = [a["key_name"] for a in pids if a["type_name"] == b["type_name"] and a["key_name"] != b["key_name"]]
    new = rng.choice(same + ["999", b["key_name"] + "0", "../0"])
    return (
        _with_pickle(members, i, P.replace_push(ops, b["key"], P.str_op(new))),
        f"storage key {b['key_name']!r} ({b['type_name']}) -> {new!r}",
    )


def storage_numel(rng: random.Random, members: list[Member]) -> Result:
    i, ops = _pickle(members)
    pid = rng.choice(P.persid_ops(ops))
    new = P.near_ints(rng, pid["numel_value"])
    return (
        _with_pickle(members, i, P.replace_push(ops, pid["numel"], P.int_op(new))),
        f"storage {pid['key_name']!r}: numel {pid['numel_value']} -> {new}",
    )


def storage_location(rng: random.Random, members: list[Member]) -> Result:
    i, ops = _pickle(members)
    pid = rng.choice(P.persid_ops(ops))
    new = rng.choice(["cuda:0", "meta", "cpu:1", "CPU", "mps", ""])
    return (
        _with_pickle(members, i, P.replace_push(ops, pid["location"], P.str_op(new))),
        f"storage {pid['key_name']!r}: location -> {new!r}",
    )


def int_argument(rng: random.Random, members: list[Member]) -> Result:
    """An int argument anywhere in the pickle (offsets, sizes, strides, numels...)."""
    i, ops = _pickle(members)
    j = rng.choice(P.int_positions(ops))
    new = P.near_ints(rng, ops[j][1])
    ops = list(ops)
    old, ops[j] = ops[j][1], P.int_op(new)
    return _with_pickle(members, i, ops), f"int at op {j}: {old} -> {new}"


def string_argument(rng: random.Random, members: list[Member]) -> Result:
    """A string anywhere in the pickle (dict keys, storage keys, devices) becomes another of its strings."""
    i, ops = _pickle(members)
    positions = P.str_positions(ops)
    j = rng.choice(positions)
    new = ops[rng.choice(positions)][1]
    old = ops[j][1]
    return _with_pickle(members, i, P.replace_push(ops, j, P.str_op(new))), f"string at op {j}: {old!r} -> {new!r}"


def dict_duplicate(rng: random.Random, members: list[Member]) -> Result:
    """A dict entry written twice: the same key again, with its own value or another entry's."""
    i, ops = _pickle(members)
    pairs = P.setitem_pairs(ops)
    a, b = rng.choice(pairs), rng.choice(pairs)
    key = ops[a[0]][1]
    copy = [ops[a[0]]] + ops[b[0] + 1 : b[1]]
    at = rng.choice([a[1], a[0]])
    new = ops[:at] + copy + ops[at:]
    return (
        _with_pickle(members, i, new),
        f"dict key {key!r} repeated {'after' if at == a[1] else 'before'} its entry, "
        f"with the value of {ops[b[0]][1]!r}",
    )


def dict_swap(rng: random.Random, members: list[Member]) -> Result:
    i, ops = _pickle(members)
    pairs = P.setitem_pairs(ops)
    a, b = sorted(rng.sample(pairs, 2))
    if a[1] > b[0]:
        return None
    new = ops[: a[0]] + ops[b[0] : b[1]] + ops[a[1] : b[0]] + ops[a[0] : a[1]] + ops[b[1] :]
    return _with_pickle(members, i, new), f"dict entries {ops[a[0]][1]!r} and {ops[b[0]][1]!r} swapped"


def byteorder(rng: random.Random, members: list[Member]) -> Result:
    i = find(members, "byteorder")
    new = rng.choice([b"big", b"big", b"little", b"", b"BIG", b"little\n", b"native", None])
    if new is None:
        return members[:i] + members[i + 1 :], "byteorder record dropped"
    return with_data(members, i, new), f"byteorder record {members[i].data!r} -> {new!r}"


def version(rng: random.Random, members: list[Member]) -> Result:
    name = rng.choice(["version", ".format_version", ".storage_alignment"])
    i = find(members, name)
    new = rng.choice([b"1", b"2", b"3", b"4", b"9", b"", b"3\n", b"abc", b"0", b"128", None])
    if new is None:
        return members[:i] + members[i + 1 :], f"{name} record dropped"
    return with_data(members, i, new), f"{name} record {members[i].data!r} -> {new!r}"


def member_drop(rng: random.Random, members: list[Member]) -> Result:
    i = rng.randrange(len(members))
    return members[:i] + members[i + 1 :], f"member {members[i].name} dropped"


def member_duplicate(rng: random.Random, members: list[Member]) -> Result:
    """A second member of one name, holding another member's bytes (of the same size where one is)."""
    i = rng.randrange(len(members))
    same = [m for j, m in enumerate(members) if j != i and len(m.data) == len(members[i].data)]
    donor = rng.choice(same or members)
    extra = Member(members[i].name, donor.data)
    at = rng.choice([i, i + 1, len(members)])
    return members[:at] + [extra] + members[at:], (
        f"member {members[i].name} doubled at position {at} with the bytes of {donor.name}"
    )


def member_rename(rng: random.Random, members: list[Member]) -> Result:
    a, b = rng.sample(range(len(members)), 2)
    out = list(members)
    out[a], out[b] = replace(out[a], name=members[b].name), replace(out[b], name=members[a].name)
    return out, f"members {members[a].name} and {members[b].name} swap names"


def member_reorder(rng: random.Random, members: list[Member]) -> Result:
    out = list(members)
    rng.shuffle(out)
    return out, "members shuffled: " + ", ".join(m.name.split("/", 1)[-1] for m in out[:6])


def local_header(rng: random.Random, members: list[Member]) -> Result:
    """The local header disagrees with the central directory: its name, its sizes or the CRC."""
    i = rng.randrange(len(members))
    m = members[i]
    kind = rng.choice(["name", "size", "crc"])
    if kind == "name":
        other = rng.choice([x.name for x in members if x.name != m.name])
        new = replace(m, local_name=other)
        what = f"local name {other}"
    elif kind == "size":
        new = replace(m, local_size=max(0, len(m.data) + rng.choice([-4, -1, 1, 8])))
        what = f"local size {new.local_size}"
    else:
        new = replace(m, crc=rng.getrandbits(32))
        what = "a CRC that does not match"
    out = list(members)
    out[i] = new
    return out, f"member {m.name}: {what} (central directory unchanged)"


def member_deflate(rng: random.Random, members: list[Member]) -> Result:
    i = rng.randrange(len(members))
    out = list(members)
    out[i] = replace(members[i], deflate=True)
    return out, f"member {members[i].name} deflated"


def record_size(rng: random.Random, members: list[Member]) -> Result:
    """A storage record longer or shorter than its persistent id says."""
    data = [i for i, m in enumerate(members) if "/data/" in m.name]
    i = rng.choice(data)
    delta = rng.choice([-8, -4, -2, -1, 1, 2, 4, 8, 64])
    blob = members[i].data
    new = blob[:delta] if delta < 0 else blob + bytes(rng.getrandbits(8) for _ in range(delta))
    return with_data(members, i, new), f"storage record {members[i].name}: {len(blob)} -> {len(new)} bytes"


def archive_prefix(rng: random.Random, members: list[Member]) -> Result:
    """The archive's folder name changed for every member, or for one."""
    new = rng.choice(["archive", "x", "a/b", ""])
    if rng.random() < 0.5:
        return (
            [replace(m, name=f"{new}/{m.name.split('/', 1)[1]}" if new else m.name.split("/", 1)[1]) for m in members],
            f"every member's folder -> {new!r}",
        )
    i = rng.randrange(len(members))
    out = list(members)
    out[i] = replace(members[i], name=f"{new}/{members[i].name.split('/', 1)[1]}")
    return out, f"member {members[i].name}: folder -> {new!r}"


OPERATORS = {
    "ts-storage-type": storage_type,
    "ts-storage-key-two-types": storage_key_two_types,
    "ts-storage-key": storage_key,
    "ts-storage-numel": storage_numel,
    "ts-storage-location": storage_location,
    "ts-int-argument": int_argument,
    "ts-string-argument": string_argument,
    "ts-dict-duplicate": dict_duplicate,
    "ts-dict-swap": dict_swap,
    "zip-byteorder": byteorder,
    "zip-version": version,
    "zip-member-drop": member_drop,
    "zip-member-duplicate": member_duplicate,
    "zip-member-rename": member_rename,
    "zip-member-reorder": member_reorder,
    "zip-local-header": local_header,
    "zip-member-deflate": member_deflate,
    "zip-record-size": record_size,
    "zip-archive-prefix": archive_prefix,
}


def framework_load(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)  # as one reads a GPU checkpoint on a CPU


def mutate(name: str, rng: random.Random, fixture, out):
    """The mutant `name` makes of the archive `fixture`, written to `out` (None: nothing to mutate)."""
    from helpers.oracle_verdict import Mutant
    from helpers.oracle_zip import read_members, write

    result = OPERATORS[name](rng, read_members(fixture))
    if result is None:
        return None
    members, what = result
    write(out, members)
    return Mutant("torch_save", name, f"{fixture.name}: {what}", out)
