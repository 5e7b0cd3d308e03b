"""Outputs of consolidate, reshard and convert stay byte-identical through refactors.

The digests in tests/data/output_digests.json were written by tests/helpers/pin_outputs.py before the
refactor. A change here means a command now writes different bytes for the same fixture: either
a bug, or an intended format change, which is then re-pinned on purpose (and said so in the commit).
"""

from __future__ import annotations

import json

from helpers import pin_outputs
from conftest import has_zstd


def test_outputs_match_pinned_digests():
    pinned = json.loads(pin_outputs.DIGESTS.read_text())["cases"]
    assert sorted(pinned) == sorted(cid for cid, _, _ in pin_outputs.CASES), (
        "tests/helpers/pin_outputs.py CASES and tests/data/output_digests.json disagree: "
        "re-run tests/helpers/pin_outputs.py"
    )
    skipped = set() if has_zstd() else {cid for cid, src, _ in pin_outputs.CASES if "zstd" in src}
    got = pin_outputs.compute_all(skip=skipped)
    changes = []
    for cid, want in pinned.items():
        if cid in skipped:
            continue
        have = got[cid]
        if "error" in have:
            changes.append(f"{cid}: {have['error']}")
            continue
        for name in sorted(set(want) | set(have)):
            if want.get(name) != have.get(name):
                state = "missing" if name not in have else "new" if name not in want else "bytes differ"
                changes.append(f"{cid}: {name} ({state})")
    assert not changes, "outputs changed:\n  " + "\n  ".join(changes)
