"""--dtype is a strict choice: every command that takes it is listed here, any spelling outside the
listed choices is refused in one sentence naming it, and the help lists exactly what is accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.corrupt import assert_error, leftovers, run_cli

ROOT = Path(__file__).resolve().parents[2]


DTYPE_COMMANDS = ["consolidate"]  # every command with --dtype (test_every_dtype_option_is_listed checks)


def test_every_dtype_option_is_listed():
    from ckptkit_cli.main import cli

    having = sorted(name for name, cmd in cli.commands.items() if any(p.name == "dtype" for p in cmd.params))
    assert having == DTYPE_COMMANDS


@pytest.mark.parametrize("command", DTYPE_COMMANDS)
@pytest.mark.parametrize(
    "value,named",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("float64", "'float64'"),
        ("fp64", "'fp64'"),
        ("double", "'double'"),
        ("float8_e4m3fn", "'float8_e4m3fn'"),
        ("torch.fp16", "'torch.fp16'"),
    ],
)
def test_dtype_outside_the_listed_choices_is_refused(command, value, named, tmp_path):
    out = tmp_path / "OUT"
    res = run_cli(command, ROOT / "fixtures" / "data" / "fsdp2_w2", out, "--dtype", value)
    assert_error(res, "--dtype", named, out=out)
    assert not out.exists() and not leftovers(out)


def test_dtype_help_lists_exactly_the_accepted_spellings():
    """Every spelling the help lists is accepted, and the accepted set is the help's."""
    from ckptkit.index.dtypes import DTYPE_SPELLINGS, parse_dtype_option
    from ckptkit_cli.main import cli

    help_text = next(p for p in cli.commands["consolidate"].params if p.name == "dtype").help
    for spelling, name in DTYPE_SPELLINGS.items():
        assert spelling in help_text
        assert parse_dtype_option(spelling) == name
    assert set(DTYPE_SPELLINGS.values()) == {"bfloat16", "float16", "float32"}
