"""A bug inside ckptkit's unpickler is reported as a bug (exit 3, cause under --debug), not as bad input.

Turning every exception into "cannot read pickle" (a FormatError, exit 2) and dropping its cause
would make a TypeError of ckptkit's own read as a user's broken file: only the unpickler's
refusals and malformed input are CkptkitErrors; the bug here is injected by replacing
the grammar's call with one that raises, and the fenced C road's call too (safeload.fence: a bug
there makes the road decline, and the machine, meeting the same bug, reports it).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from click.testing import CliRunner

from cli.main import cli
from ckptkit.errors import FormatError, InternalError, UnsafePickleError
from ckptkit.safeload import restricted_loads
from ckptkit.safeload.fence import Call
from ckptkit.safeload.grammar import RestrictedGrammar
from conftest import DATA

SRC = DATA / "plain_state_dict.pt"  # its pickle calls torch's tensor rebuild: the grammar's call runs


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.fixture
def buggy_grammar(monkeypatch):
    def call(self, func, args):
        raise TypeError("injected bug")

    monkeypatch.setattr(RestrictedGrammar, "call", call)

    def fenced_call(self, *args):
        raise TypeError("injected bug")

    monkeypatch.setattr(Call, "__call__", fenced_call)


def test_a_bug_is_exit_3_not_bad_input(buggy_grammar):
    result = CliRunner().invoke(cli, ["inspect", str(SRC)])
    assert result.exit_code == 3, result.output
    assert "internal error" in result.output and "plain_state_dict.pt" in result.output
    assert "injected bug" in result.output and "cannot read pickle" not in result.output


def test_debug_shows_the_bug_as_the_cause(buggy_grammar):
    result = CliRunner().invoke(cli, ["--debug", "inspect", str(SRC)])
    assert result.exit_code == 3, result.output
    assert "TypeError: injected bug" in result.output
    assert "direct cause" in result.output  # the traceback chains the bug to the InternalError


def test_the_library_raises_internal_error_with_its_cause(buggy_grammar):
    import zipfile

    with zipfile.ZipFile(SRC) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    with pytest.raises(InternalError, match="x.pkl: the restricted unpickler failed") as info:
        restricted_loads(data, "x.pkl", lambda pid: None)
    assert isinstance(info.value.__cause__, TypeError)


def test_hostile_and_malformed_input_are_still_exit_2(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "x": _Evil()}, evil)
    result = CliRunner().invoke(cli, ["inspect", str(evil)])
    assert result.exit_code == 2, result.output
    assert re.search(r"evil.pt: refusing to unpickle global '(os|posix|nt).system'", result.output), result.output
    with pytest.raises(UnsafePickleError):
        restricted_loads(b"\x80\x04cos\nsystem\n.", "x.pkl")
    with pytest.raises(FormatError, match="x.pkl: pickle is truncated"):
        restricted_loads(b"\x80\x04]\x94(K\x01", "x.pkl")
    with pytest.raises(FormatError, match="x.pkl: pickle holds text that is not UTF-8"):  # found by the fuzz test
        restricted_loads(b"\x80\x04\x8c\x02\xff\xfe\x94.", "x.pkl")


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x02N)\x81.",  # NEWOBJ of None: looked like a known stand-in (the lookup's default was None)
        b"\x80\x04N)}\x92.",  # NEWOBJ_EX of None
        b"\x80\x02K\x01)\x81.",  # NEWOBJ of an int
    ],
    ids=["newobj-none", "newobj_ex-none", "newobj-int"],
)
def test_newobj_of_a_value_that_is_not_a_class_is_refused(payload):
    """Found by test_reliability's fuzzer once bugs stopped being disguised as bad input: NEWOBJ
    with None as the class passed the stand-in check and reached None.__new__ (exit 3)."""
    with pytest.raises(UnsafePickleError):
        restricted_loads(payload, "x.pkl")
