"""A careless user and an attacker against environment knobs set to garbage and the size and
tolerance options (what they share and the contract: tests/helpers/cli_contract.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.cli_contract import DATA, DCP, PLAIN, ROOT, one_sentence as _one_sentence, run_ckptkit as _ckptkit


# ---- environment knobs set to garbage ------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value",
    [
        ("CKPTKIT_MEMORY_BUDGET", "lots"),
        ("CKPTKIT_WORKERS", "four"),
        ("CKPTKIT_MAX_PICKLE_DEPTH", "deep"),
        ("CKPTKIT_PROGRESS_INTERVAL", "often"),
    ],
)
def test_a_garbage_knob_is_one_sentence_naming_it(name, value):
    res = _ckptkit("inspect", PLAIN, env={name: value})
    _one_sentence(res)
    assert name in res.stderr


def test_memory_budget_knob_with_the_units_the_option_takes():
    res = _ckptkit("verify", "--deep", PLAIN, env={"CKPTKIT_MEMORY_BUDGET": "1GB"})
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode in (0, 2), res.stderr[-2000:]
    if res.returncode == 2:
        _one_sentence(res)


# Out of range: what the matching option (--workers: 1 to 64; --memory-budget: a size of at least 1
# byte) refuses, the variable refuses the same way instead of being ignored or clamped.
@pytest.mark.parametrize(
    "name,value",
    [
        ("CKPTKIT_WORKERS", "0"),
        ("CKPTKIT_WORKERS", "-3"),
        ("CKPTKIT_WORKERS", "1000"),
        ("CKPTKIT_WORKERS", "2.5"),
        ("CKPTKIT_MEMORY_BUDGET", "0"),
        ("CKPTKIT_MEMORY_BUDGET", "-5"),
        ("CKPTKIT_MEMORY_BUDGET", "nanGB"),
        ("CKPTKIT_MEMORY_BUDGET", "1e-9KB"),
        ("CKPTKIT_MAX_PICKLE_OBJECTS", "0"),
        ("CKPTKIT_MAX_PICKLE_DEPTH", "5000"),
        ("CKPTKIT_MAX_PICKLE_EXPANDED", "many"),
        ("CKPTKIT_MAX_PICKLE_BLOB", "huge"),
        ("CKPTKIT_MAX_PICKLE_BUILT", "-1"),
        ("CKPTKIT_MAX_PICKLE_SECONDS", "nan"),
        ("CKPTKIT_MAX_JSON_DEPTH", "-1"),
        ("CKPTKIT_PROGRESS_INTERVAL", "-1"),
        ("CKPTKIT_DIST_TIMEOUT", "inf"),
    ],
)
def test_a_knob_out_of_range_is_refused_like_its_option(name, value):
    res = _ckptkit("inspect", PLAIN, env={name: value})
    _one_sentence(res)
    assert name in res.stderr and repr(value) in res.stderr


def test_every_knob_of_the_table_is_checked_by_the_command_line():
    """A knob added to knobs.KNOBS is checked before a command starts: each one set to garbage."""
    from ckptkit import knobs

    for knob in knobs.KNOBS.values():
        res = _ckptkit("inspect", PLAIN, env={knob.env: "garbage"})
        _one_sentence(res)
        assert knob.env in res.stderr


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("CKPTKIT_MEMORY_BUDGET", "2GiB", 2 << 30),
        ("CKPTKIT_MEMORY_BUDGET", "1048576", 1 << 20),
        ("CKPTKIT_WORKERS", "64", 64),
        ("CKPTKIT_MAX_PICKLE_BLOB", "1MB", 10**6),
        ("CKPTKIT_PROGRESS_INTERVAL", "0", 0.0),
    ],
)
def test_a_good_knob_is_taken(name, value, expected):
    from ckptkit import knobs

    attr = next(attr for attr, knob in knobs.KNOBS.items() if knob.env == name)
    code = f"import ckptkit.knobs as k; print(repr(k.{attr}))"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{name: value})
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == repr(expected)


# The library: importing ckptkit never fails because of the environment; the knob refuses when used.
_LIBRARY = """
import ckptkit, ckptkit.api, ckptkit.safeload, ckptkit.context, ckptkit.runner.distributed
from ckptkit import knobs
from ckptkit.errors import UsageError
try:
    knobs.{attr}
except UsageError as exc:
    print("refused:", exc)
try:
    ckptkit.context.RunContext()
except UsageError as exc:
    print("context refused:", exc)
"""


@pytest.mark.parametrize(
    "name,value,attr",
    [
        ("CKPTKIT_WORKERS", "four", "WORKERS"),
        ("CKPTKIT_MEMORY_BUDGET", "0", "MEMORY_BUDGET"),
        ("CKPTKIT_MAX_PICKLE_DEPTH", "deep", "MAX_PICKLE_DEPTH"),
        ("CKPTKIT_DIST_TIMEOUT", "soon", "DIST_TIMEOUT"),
    ],
)
def test_the_library_imports_and_refuses_the_knob_when_used(name, value, attr):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{name: value})
    res = subprocess.run(
        [sys.executable, "-c", _LIBRARY.format(attr=attr)], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    refused = [ln for ln in res.stdout.splitlines() if ln.startswith("refused:")]
    assert len(refused) == 1 and name in refused[0] and repr(value) in refused[0], res.stdout
    if attr in ("WORKERS", "MEMORY_BUDGET"):  # what a RunContext takes its defaults from
        assert "context refused:" in res.stdout, res.stdout


# ---- size and tolerance options ------------------------------------------------------------------


@pytest.mark.parametrize(
    "option,size",
    [
        ("--max-shard-size", "nanGB"),
        ("--max-shard-size", "1e400KB"),
        ("--memory-budget", "infGB"),
    ],
)
def test_a_size_that_is_no_number_of_bytes_is_refused(tmp_path, option, size):
    out = tmp_path / "out"
    res = _ckptkit("consolidate", option, size, PLAIN, out)
    _one_sentence(res)
    assert option in res.stderr
    assert not out.exists()


def test_a_size_that_rounds_to_zero_bytes_is_refused_like_zero(tmp_path):
    out = tmp_path / "out"
    res = _ckptkit("consolidate", "--max-shard-size", "1e-9KB", PLAIN, out)
    _one_sentence(res)
    assert "--max-shard-size" in res.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "option,size",
    [
        ("--max-shard-size", "1e-9KB"),
        ("--memory-budget", "1e-9KB"),
        ("--memory-budget", "0.5B"),
        ("--memory-budget", "1e300KB"),
    ],
)
def test_a_size_option_refuses_what_is_less_than_a_byte_or_more_than_any_file(tmp_path, option, size):
    out = tmp_path / "out"
    res = _ckptkit("consolidate", option, size, PLAIN, out)
    _one_sentence(res)
    assert option in res.stderr and repr(size) in res.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("5GB", 5 * 10**9),
        ("2GiB", 2 << 30),
        ("1.5KB", 1500),
        ("123", 123),
        (" 2 mb ", 2 * 10**6),
        ("1B", 1),
        (7, 7),
    ],
)
def test_parse_size_takes_sizes(text, expected):
    from ckptkit import knobs

    assert knobs.parse_size(text, "--x") == expected


@pytest.mark.parametrize(
    "text",
    [
        "nanGB",
        "NaN",
        "infGB",
        "-infKB",
        "1e400KB",
        "1e300GB",
        str(1 << 64),
        "1e-9KB",
        "0",
        "0B",
        "-5",
        "0.4B",
        "",
        "GB",
        "lots",
        0,
        -1,
        True,
        1.5,
    ],
)
def test_parse_size_refuses_what_is_no_number_of_bytes(text):
    from ckptkit import knobs
    from ckptkit.errors import UsageError

    with pytest.raises(UsageError, match="^--x: "):
        knobs.parse_size(text, "--x")


def test_diff_takes_an_infinite_tolerance():
    """docs/cli.md: `--atol inf` counts every difference close but a NaN on one side only."""
    exact = _ckptkit("diff", DCP, DATA / "fsdp2_w3")
    assert exact.returncode == 1, exact.stderr[-2000:]  # resharding changed some bits: not equal at atol 0
    res = _ckptkit("diff", "--atol=inf", DCP, DATA / "fsdp2_w3")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "(atol inf)" in res.stdout and "equal" in res.stdout.splitlines()


@pytest.mark.parametrize("atol", ["nan", "-1", "-inf", "-1e-300"])
def test_diff_refuses_a_tolerance_that_is_no_tolerance(atol):
    res = _ckptkit("diff", f"--atol={atol}", PLAIN, PLAIN)
    _one_sentence(res)
    assert "--atol" in res.stderr
