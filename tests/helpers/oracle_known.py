"""Findings of the differential oracle that are filed and being fixed in the readers: each is
recognised by what the mutant file holds (not by the operator that made it, since several
operators reach one bug) and by the verdict's wording. The oracle expects them strictly: a KNOWN
entry that no mutant of the CI run hits any more is a failure too, saying the entry is stale.

When a fix is merged, delete its entry here: the oracle then checks that class like any other.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from helpers import oracle_pickle as P
from helpers.oracle_verdict import Mutant


@dataclass(frozen=True)
class Known:
    fmt: str
    what: str
    holds: Callable[[Mutant], bool]  # the mutant file has the known defect
    verdict: str  # a regex the finding's verdict matches

    def matches(self, mutant: Mutant, verdict: str) -> bool:
        return mutant.fmt == self.fmt and re.search(self.verdict, verdict) is not None and self.holds(mutant)


def _member(mutant: Mutant, suffix: str) -> bytes | None:
    """The last member named <folder>/<suffix> (zipfile's choice among doubles), or None."""
    try:
        with zipfile.ZipFile(mutant.path) as z:
            names = [i for i in z.infolist() if i.filename.split("/", 1)[-1] == suffix]
            return z.read(names[-1]) if names else None
    except (zipfile.BadZipFile, KeyError, ValueError, OSError):
        return None


def byteorder_is(*values: bytes) -> Callable[[Mutant], bool]:
    return lambda m: _member(m, "byteorder") in values


def byteorder_unknown(mutant: Mutant) -> bool:
    value = _member(mutant, "byteorder")
    return value is not None and value not in (b"little", b"big")


def storage_key_with_two_types(mutant: Mutant) -> bool:
    data = _member(mutant, "data.pkl")
    if data is None:
        return False
    try:
        pids = P.persid_ops(P.parse(data))
    except Exception:  # noqa: BLE001 - a pickle the mutation left unparsable has no such ids
        return False
    types: dict = {}
    for pid in pids:
        types.setdefault(pid["key_name"], set()).add(pid["type_name"])
    return any(len(t) > 1 for t in types.values())


def alias_names_a_held_tensor(mutant: Mutant) -> bool:
    from helpers.oracle_safetensors import read
    from ckptkit.formats.safetensors.reader import ALIASES_KEY

    try:
        header = dict(read(mutant.path)[0])
        aliases = json.loads(header.get("__metadata__", {}).get(ALIASES_KEY, "{}"))
    except (ValueError, AttributeError, TypeError):
        return False
    return isinstance(aliases, dict) and any(name in header for name in aliases)


KNOWN: list[Known] = []
