"""safeload.fence.scan matches short strings (BINUNICODE, SHORT_BINUNICODE) in its regex rather
than one loop iteration each (a ZeRO-3 model-states data.pkl holds 60k of them), and
takes or declines exactly what it did with the loop alone."""

from __future__ import annotations

import pickle
import random
import zipfile

import ckptkit.safeload.fence as fence
from conftest import DATA


def _outcome(data: bytes, floats: bool, persistent: bool) -> str:
    try:
        fence.scan(data, floats, persistent)
        return "taken"
    except fence.Decline:
        return "declined"


def _seeds() -> list[bytes]:
    values = [{"a": [1, 2.5, "x" * k, b"y" * k], "b": ("\u00e9" * k,)} for k in (0, 1, 5, 63, 64, 127, 128, 300)]
    seeds = [pickle.dumps(v, protocol=p) for v in values for p in (2, 4, 5)]
    with zipfile.ZipFile(DATA / "plain_state_dict.pt") as z:
        seeds += [z.read(n) for n in z.namelist() if n.endswith("/data.pkl")]
    return seeds


def test_short_strings_are_the_regexs():
    data = pickle.dumps(["name%d" % i for i in range(1000)] + ["x" * 127, "y" * 128], protocol=2)
    run = fence._run_for(len(data), False)
    stop = run.match(data, 2).end()
    assert data[stop : stop + 1] == b"X" and data[stop + 1 : stop + 5] == (128).to_bytes(4, "little")
    data4 = pickle.dumps(["n%d" % i for i in range(1000)], protocol=4)
    assert data4[2] == 0x95  # (a FRAME: the scan's loop notes where each is)
    assert fence._run_for(len(data4), False).match(data4, 11).end() >= len(data4) - 3


def test_mutated_pickles_are_taken_or_declined_as_by_the_loop_alone(monkeypatch):
    rng = random.Random(17)
    seeds = _seeds()
    for _ in range(3000):
        d = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            k = rng.randrange(len(d))
            r = rng.random()
            if r < 0.5:
                d[k] = rng.randrange(256)
            elif r < 0.75:
                del d[k : k + rng.randint(1, 8)]
            else:
                d[k:k] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
        data = bytes(d)
        for floats, persistent in ((True, True), (False, False)):
            monkeypatch.setattr(fence, "_SHORT", 128)
            fast = _outcome(data, floats, persistent)
            monkeypatch.setattr(fence, "_SHORT", 0)
            assert _outcome(data, floats, persistent) == fast, data[:80]


def test_a_string_past_a_lowered_blob_limit_is_still_declined(monkeypatch):
    monkeypatch.setattr(fence.knobs, "MAX_PICKLE_BLOB", 10)
    assert _outcome(pickle.dumps(["x" * 11], protocol=2), False, False) == "declined"
    assert _outcome(pickle.dumps(["x" * 10], protocol=2), False, False) == "taken"
