"""DeepSpeed's default tag `global_stepN`, spelled by names.py alone and reached above the formats
through the adapter's `Capabilities.step_folders` (registry.step_folder_name, is_step_folder)."""

from __future__ import annotations

import pytest

from ckptkit.errors import UnsupportedError
from ckptkit.formats import registry
from ckptkit.formats.deepspeed.names import parse_step_tag, step_tag


@pytest.mark.parametrize("step", [0, 7, 120000])
def test_step_tag_and_its_parse_are_inverse(step):
    assert parse_step_tag(step_tag(step)) == step
    assert registry.step_folder_name("deepspeed", step) == step_tag(step)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("global_step12", True),
        ("global_step", False),
        ("global_step12x", False),
        ("step_12", False),
        ("checkpoint-3", False),
    ],
)
def test_is_step_folder_recognises_only_a_tag(name, expected):
    assert registry.is_step_folder(name) is expected


def test_a_format_without_step_folders_is_refused_in_one_sentence():
    with pytest.raises(UnsupportedError, match="names no step folders"):
        registry.step_folder_name("dcp", 3)
