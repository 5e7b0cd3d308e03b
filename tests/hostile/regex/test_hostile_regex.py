"""Regular expressions that would hang ckptkit (catastrophic backtracking) are refused quickly, in
one sentence, wherever they come from: a `--tp-rules` file, a checkpoint's
`universal_checkpoint_info`, `--partition-method type:REGEX`. The patterns real users and
DeepSpeed write stay accepted.

Each hostile pattern here got past the textual check this replaced (tp_rules._NESTED_REPEAT): the
command-line runs are subprocesses with a timeout, so a pattern that slips through again fails
its test instead of hanging the suite.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers.corrupt import DATA, ROOT

from ckptkit.convert.tp_rules import MAX_NAME, TpRule, TpRules, TpSplit, builtin_rules, check_regex, recorded_rules
from ckptkit.errors import FormatError, UsageError
from ckptkit.formats.deepspeed.pipeline_partition import type_regex
from ckptkit.regex_guard import MAX_PATTERN, regex_refusal

TIMEOUT_S = 20
TWELVE_DOT_STARS = ".*" * 12 + "Z"

# (pattern, a word the refusal must hold): each would backtrack for minutes to hours on a
# parameter name that almost matches, or refers back to a group
HOSTILE = [
    ("((.)+)+Z", "exponential"),
    ("(.+){1,100}Z", "exponential"),
    (TWELVE_DOT_STARS, "unbounded repeats"),
    ("(a|a)*Z", "alternation"),
    ("(a|aa)+Z", "exponential"),
    (r"(\w+\s?)+Z", "exponential"),
    ("(?:x+x+)+y", "exponential"),
    (r"(\w|\d)+X", "alternation"),
    ("(?:a|b|ab)*c", "exponential"),
    ("(?=(a+)+)Z", "exponential"),
    ("(?:(?=a+)a)+Z", "exponential"),
    ("(?!(?:a|aa)+)Z", "exponential"),
    ("(?<=x)(?:.*a){2,}Z", "exponential"),
    (r"(a+)\1Z", "refers back"),
    ("(?P<n>a+)(?P=n)+", "exponential"),
    ("(?P<n>a)(?P=n)Z", "refers back"),
    ("(a)?(?(1)a|b)+Z", "refers back"),
    ("(.+){2}Z", "exponential"),
    ("(.*)*Z", "exponential"),
    ("a?" * 12 + "a" * 12, "ways"),
    ("(a|a)" * 12 + "Z", "ways"),
    ("((a?b?c?){4}){4}Z", "ways"),
    ("(?x)(a + ) + Z", "verbose"),
    ("a" * (MAX_PATTERN + 1), "characters"),
]
IDS = [f"{i}-{p[:24]}" for i, (p, _) in enumerate(HOSTILE)]

# what users write for tensor names (docs/tp_rules.md, bug reports), each with a name it matches
USERS = [
    (r".*\.q_proj\.weight", "model.layers.0.self_attn.q_proj.weight"),
    (r"layers\.\d+\.mlp\.(gate|up)_proj\.weight", "layers.11.mlp.gate_proj.weight"),
    (r"^model\.embed_tokens\.weight$", "model.embed_tokens.weight"),
    (r"(.*)\.weight", "lm_head.weight"),
    (r".*norm\.(weight|bias)$", "model.norm.weight"),
    (r".*\.(dense_h_to_4h)\.(weight|bias)", "layers.0.mlp.dense_h_to_4h.bias"),
    (r".*\.layers\.\d+\.mlp\.experts\.\d+\.w1\.weight", "model.layers.3.mlp.experts.7.w1.weight"),
    (r"(?:model\.)?layers\.[0-9]+\.self_attn\.[qkv]_proj\.(?:weight|bias)", "layers.2.self_attn.k_proj.bias"),
    (r"model\.layers\.\d{1,3}\.mlp\.down_proj\.weight", "model.layers.42.mlp.down_proj.weight"),
    (r"(?:[0-9a-f]{2})+\.weight", "0a1b.weight"),
    (r"(?>.*)\.weight|.*\.bias", "x.bias"),
]

# Megatron-DeepSpeed's universal_checkpoint_info (megatron/model/gpt_model.py and its
# ds_to_universal users), written as re.match patterns
MEGATRON_DEEPSPEED = [
    r"tied_modules.embed.word_embeddings.weight",
    r"\d+.word_embeddings.weight",
    r"tied_modules.embed.position_embeddings.weight",
    r"tied_modules.embed.word_embeddings.norm.weight",
    r"tied_modules.embed.word_embeddings.norm.bias",
    r"\d+.input_layernorm.weight",
    r"\d+.input_layernorm.bias",
    r"\d+.post_attention_layernorm.weight",
    r"\d+.post_attention_layernorm.bias",
    r"\d+.self_attention.dense.bias",
    r"\d+.mlp.dense_4h_to_h.bias",
    r"\d+.weight",
    r"\d+.bias",
    r"\d+.mlp.dense_4h_to_h.weight",
    r"\d+.self_attention.dense.weight",
    r"\d+.mlp.dense_h_to_4h.weight",
    r"\d+.mlp.dense_h_to_4h.bias",
    r"\d+.mlp.deepspeed_moe.gate.wg.weight",
    r"\d+.mlp.moe.deepspeed_moe.gate.wg.weight",
]
# DeepSpeed's own (deepspeed/module_inject/autotp_config.py presets, runtime/engine.py,
# checkpoint/ds_to_universal.py), as of the installed version; more are read from the source below
DEEPSPEED = [
    r".*\.experts\.w[123]$",
    r"\.experts\.w[123]$",
    r".*\.self_attn\.o_proj\.weight$",
    r".*\.self_attn\.[qkv]_proj\.weight$",
    r".*\.mlp\.down_proj\.weight$",
    r".*\.mlp\.(up|gate)_proj\.weight$",
    r".*\.self_attention\.query_key_value\.weight$",
    r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$",
    r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$",
    r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$",
    r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$",
    r".*\.mlp\.gate_up_proj\.weight$",
    r"(\w+)DecoderLayer",
    r"(\w+)Block",
    r"(\w+)Layer",
    r"model\.layers\.\d+\.mlp",
]
# AutoTP records each parameter as rf"^{re.escape(name)}$" (collect_autotp_universal_checkpoint_info)
AUTOTP_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.31.mlp.experts.63.gate_up_proj",
    "transformer.h.0.attn.c_attn.weight",
    "model.language_model.layers.47.self_attn.qkv_proj.weight" * 3,
]


# ---- the check itself ---------------------------------------------------------------------


@pytest.mark.parametrize("pattern,word", HOSTILE, ids=IDS)
def test_a_hostile_pattern_is_refused_quickly_in_one_sentence(pattern: str, word: str) -> None:
    start = time.monotonic()
    with pytest.raises(FormatError) as caught:
        check_regex(pattern, "rules file 'r.json': rule 0")
    assert time.monotonic() - start < 1.0
    message = str(caught.value)
    assert message.startswith("rules file 'r.json': rule 0: ") and "\n" not in message, message
    assert word in message, message
    assert pattern[:20].replace("\\", "\\\\") in message or len(pattern) > 80, message


@pytest.mark.parametrize("pattern,name", USERS, ids=[p for p, _ in USERS])
def test_the_patterns_users_write_are_accepted_and_match(pattern: str, name: str) -> None:
    assert check_regex(pattern, "user") == pattern
    assert TpRule("re:" + pattern, TpSplit("split", 0)).matches(name)


def _deepspeed_source_patterns() -> list[str]:
    """String literals that the installed DeepSpeed passes as patterns (a `patterns=[...]`
    keyword, a *_PATTERNS key of universal_checkpoint_info), read from its source."""
    try:
        import deepspeed  # noqa: F401  (only its files are read)
    except Exception:
        return []
    root = Path(sys.modules["deepspeed"].__file__).parent
    found: set[str] = set()
    for name in (
        "module_inject/autotp_config.py",
        "runtime/engine.py",
        "checkpoint/ds_to_universal.py",
        "module_inject/auto_tp.py",
    ):
        path = root / name
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            value = None
            if isinstance(node, ast.keyword) and node.arg == "patterns":
                value = node.value
            elif isinstance(node, ast.Assign) and "PATTERNS" in ast.unparse(node.targets[0]):
                value = node.value
            for leaf in ast.walk(value) if value is not None else ():
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str) and leaf.value:
                    found.add(leaf.value)
    return sorted(found)


def _fixture_patterns() -> list[str]:
    """Every pattern the tensor-parallel fixtures record (DeepSpeed wrote them)."""
    found: set[str] = set()
    for path in sorted((DATA / "ds_tp").glob("*/global_step*/*mp_rank_0*_model_states.pt")):
        info = torch.load(path, weights_only=False, map_location="cpu").get("universal_checkpoint_info") or {}
        for key, value in info.items():
            if key.endswith("patterns") and isinstance(value, (list, tuple)):
                found.update(value)
            elif key.endswith("patterns") and isinstance(value, dict):
                found.update(value)
        for sub in info.get("parameter_with_sub_params") or []:
            found.update(sub.get("patterns") or [])
    return sorted(found)


def test_every_stock_pattern_is_accepted() -> None:
    """DeepSpeed's and Megatron-DeepSpeed's patterns, AutoTP's escaped names, the fixtures' and
    the built-in rules all pass the check (and still match what they were written for)."""
    from_source = _deepspeed_source_patterns()
    from_fixtures = _fixture_patterns()
    autotp = [rf"^{re.escape(name)}$" for name in AUTOTP_NAMES]
    stock = MEGATRON_DEEPSPEED + DEEPSPEED + from_source + from_fixtures + autotp
    refused = {p: regex_refusal(p) for p in stock if regex_refusal(p) is not None}
    assert not refused, refused
    for pattern in stock:
        check_regex(pattern, "stock")
    for pattern, name in zip(autotp, AUTOTP_NAMES):
        assert re.match(pattern, name)
    assert re.match(r"\d+.mlp.dense_h_to_4h.weight", "3.mlp.dense_h_to_4h.weight")
    assert builtin_rules().rules, "the built-in rules load"
    if from_source:  # the installed DeepSpeed's presets were found and read
        assert r".*\.mlp\.down_proj\.weight$" in from_source


def test_a_recorded_hostile_pattern_is_refused_under_every_key() -> None:
    """universal_checkpoint_info's lists (and the sub-params' and AutoTP's refusal patterns)
    are each held to the same check, naming the key."""
    lists = (
        "tp_replicated_parameter_patterns",
        "parameter_with_row_parallelism_patterns",
        "vocabulary_parameter_patterns",
        "parameter_with_2_sub_params_cat_dim_0",
        "parameter_to_average_patterns",
    )
    for pattern, word in HOSTILE:
        infos = [(key, {key: ["^ok$", pattern]}) for key in lists]
        infos.append(
            (
                "parameter_with_sub_params[0]: patterns[0]",
                {"parameter_with_sub_params": [{"partition_dim": 0, "shape": [[8, 8], 16], "patterns": [pattern]}]},
            )
        )
        infos.append(
            (
                "autotp_unsupported_parameter_patterns",
                {"tp_replicated_parameter_patterns": [], "autotp_unsupported_parameter_patterns": {pattern: "no"}},
            )
        )
        for key, info in infos:
            with pytest.raises(FormatError) as caught:
                recorded_rules(info, "mp_rank_00_model_states.pt")
            message = str(caught.value)
            assert "mp_rank_00_model_states.pt" in message and key in message and word in message, message


def test_a_name_longer_than_the_cap_is_refused_and_the_cap_bounds_a_match() -> None:
    """At the cap, the worst accepted shape (three unbounded repeats, a failing match) is quick;
    a longer name is refused before any pattern sees it."""
    worst = ".*.*.*Z"
    assert regex_refusal(worst) is None
    rules = TpRules((TpRule("re:" + worst, TpSplit("split", 0)),), "rules file 'r.json'")
    start = time.monotonic()
    assert rules.find("a" * MAX_NAME) is None
    assert time.monotonic() - start < 5.0
    with pytest.raises(FormatError, match=f"{MAX_NAME + 1} characters"):
        rules.find("a" * (MAX_NAME + 1))


NO_COLON = [(p, w) for p, w in HOSTILE if ":" not in p and "(?P" not in p]  # type:REGEX: lower-cased, up to a colon


@pytest.mark.parametrize("pattern,word", NO_COLON, ids=[p[:24] for p, _ in NO_COLON])
def test_partition_method_type_regex_is_held_to_the_same_check(pattern: str, word: str) -> None:
    with pytest.raises(UsageError) as caught:
        type_regex(f"type:{pattern}")
    assert "--partition-method" in str(caught.value) and word in str(caught.value)
    assert type_regex("type:transformerlayer|mlp").search("ParallelTransformerLayerPipe")


# ---- end to end, in a subprocess that a hang cannot outlive -------------------------------

PIPELINE = "ds_pp/pp2_dp2_z1_fp32"  # resharded to tp 2: every parameter goes through the rules
AUTOTP = "ds_tp/autotp_z2_fp32"  # records universal_checkpoint_info
UC = "universal_checkpoint_info"


def _ckptkit(*args: str) -> subprocess.CompletedProcess:
    """`python -m ckptkit ARGS`, killed after TIMEOUT_S (a hang fails the test, not the suite)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        return subprocess.run(
            [sys.executable, "-m", "ckptkit", *args], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptkit {' '.join(args)[:200]} ran past {TIMEOUT_S} s (a pattern backtracking?)")


def _assert_one_sentence(proc: subprocess.CompletedProcess, *names: str, usage: bool = False) -> None:
    """Exit 2, no traceback, one error sentence naming `names` (`usage`: click's bad-option
    form, a usage line and one "Error: Invalid value for '--tp-rules': ..." line)."""
    detail = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, detail
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error: " if usage else "error: ")]
    assert len(errors) == 1 and (usage or len(lines) == 1), detail
    for name in names:
        assert name in errors[0], f"{name!r} not in the sentence\n{detail}"


@pytest.mark.parametrize("pattern,word", HOSTILE, ids=IDS)
def test_cli_tp_rules_refuses_a_hostile_pattern(tmp_path: Path, pattern: str, word: str) -> None:
    if not (DATA / PIPELINE).is_dir():
        pytest.skip(f"fixture {PIPELINE} not generated")
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps({"rules": [{"pattern": "*.weight", "split": 0}, {"pattern": "re:" + pattern, "split": 0}]})
    )
    out = tmp_path / "out"
    proc = _ckptkit(
        "convert",
        str(DATA / PIPELINE),
        str(out),
        "--to",
        "dcp",
        "--world-size",
        "mesh=dp_shard:2,tp:2",
        "--tp-rules",
        str(rules),
    )
    _assert_one_sentence(proc, "--tp-rules", "rules.json", "rule 1", word)
    assert not out.exists()


def _recorded(key: str, value) -> Callable[[Path], None]:
    """Both mp ranks' universal_checkpoint_info[key] = value."""

    def craft(folder: Path) -> None:
        for name in ("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"):
            path = folder / "global_step2" / name
            obj = torch.load(path, weights_only=False)  # trusted: a copy of our own fixture
            obj[UC][key] = value
            torch.save(obj, path)

    return craft


# every hostile pattern under one key, and one pattern under every other key
RECORDED = [("tp_replicated_parameter_patterns", p, w) for p, w in HOSTILE] + [
    ("parameter_with_row_parallelism_patterns", "((.)+)+Z", "exponential"),
    ("vocabulary_parameter_patterns", TWELVE_DOT_STARS, "unbounded repeats"),
    ("parameter_to_average_patterns", "(.+){1,100}Z", "exponential"),
    ("autotp_unsupported_parameter_patterns", {"(a|aa)+Z": "hostile"}, "exponential"),
]


@pytest.mark.parametrize("key,pattern,word", RECORDED, ids=[f"{k[:12]}-{i}" for i, (k, _, _) in enumerate(RECORDED)])
def test_a_checkpoint_recording_a_hostile_pattern_is_refused(tmp_path: Path, key: str, pattern, word: str) -> None:
    if not (DATA / AUTOTP).is_dir():
        pytest.skip(f"fixture {AUTOTP} not generated")
    src = tmp_path / "src"
    shutil.copytree(DATA / AUTOTP, src)
    _recorded(key, pattern if isinstance(pattern, dict) else ["^model\\.norm\\.weight$", pattern])(src)
    out = tmp_path / "out"
    proc = _ckptkit("consolidate", str(src), str(out))
    _assert_one_sentence(proc, "mp_rank_00_model_states.pt", key, word)
    assert not out.exists()
