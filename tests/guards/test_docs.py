"""The documentation's examples run, and docs/cli.md names only options that exist.

Runnable examples are fenced code blocks in the `console` language (README.md, docs/**/*.md)
with lines starting with `$ ckptkit `. Each such command runs as
`python -m ckptkit ...` from the repository root. Conventions:

- Outputs go under `/tmp/ckptkit-docs/...`; the test rewrites that prefix to a fresh folder per
  block, so the commands of one block run in order and share their outputs.
- A block runs with exit status 0 expected for every command. `<!-- exit: N -->` on the line
  before the block expects N from the block's LAST command (earlier commands must still exit 0).
- The lines after a command, up to the next `$ ` line, are its output as shown in the docs.
  Every such line except `...` lines must appear in what the command printed (stdout and
  stderr), compared with runs of whitespace collapsed. So a table can be trimmed with `...`,
  but nothing shown may be invented.
- Blocks that run `ckptkit demo` are skipped (it trains a model on 2 processes).

All blocks run in parallel, once per session, so the whole file stays fast.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS_TMP = "/tmp/ckptkit-docs"
EXIT_MARK = re.compile(r"<!--\s*exit:\s*(\d+)\s*-->")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.exists()]


@dataclass
class Command:
    line: str  # the text after "$ "
    expected: list[str] = field(default_factory=list)
    runs: bool = True  # a `ckptkit` command (others are shown, not run)


@dataclass
class Block:
    file: Path
    lineno: int
    exit_code: int
    commands: list[Command]

    @property
    def id(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.lineno}"

    @property
    def is_demo(self) -> bool:
        return any(c.runs and shlex.split(c.line)[1:2] == ["demo"] for c in self.commands)


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```console":
            i += 1
            continue
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = EXIT_MARK.search(prev)
        start = i + 1
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        commands: list[Command] = []
        for text in body:
            if text.startswith("$ "):
                commands.append(Command(text[2:], runs=text.startswith("$ ckptkit ")))
            elif commands:
                commands[-1].expected.append(text)
        if any(c.runs for c in commands):
            blocks.append(Block(path, start, int(m.group(1)) if m else 0, commands))
        i += 1
    return blocks


ALL_BLOCKS = [b for f in doc_files() for b in parse_blocks(f)]


@dataclass
class Result:
    argv: list[str]
    returncode: int
    output: str


def _norm(text: str) -> str:
    return " ".join(text.split())


def run_block(block: Block, tmp: Path) -> list[Result]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    results = []
    for cmd in block.commands:
        if not cmd.runs:
            continue
        args = shlex.split(cmd.line.replace(DOCS_TMP, str(tmp)))
        argv = [sys.executable, "-m", "ckptkit", *args[1:]]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        results.append(Result(argv, proc.returncode, proc.stdout + proc.stderr))
    return results


@pytest.fixture(scope="session")
def block_results(tmp_path_factory) -> dict[str, tuple[Path, list[Result]]]:
    """Run every runnable block once, in parallel; each block gets its own output folder."""
    todo = []
    for n, block in enumerate(ALL_BLOCKS):
        if block.is_demo:
            continue
        tmp = tmp_path_factory.mktemp(f"docs-{n}")
        todo.append((block, tmp))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {b.id: (tmp, pool.submit(run_block, b, tmp)) for b, tmp in todo}
        return {k: (tmp, f.result()) for k, (tmp, f) in futures.items()}


def test_docs_have_runnable_examples():
    assert len([b for b in ALL_BLOCKS if not b.is_demo]) >= 10, "the docs lost their examples"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_example_runs(block: Block, block_results):
    if block.is_demo:
        pytest.skip("`ckptkit demo` trains a model on 2 processes; too slow for the docs check")
    tmp, results = block_results[block.id]
    commands = [c for c in block.commands if c.runs]
    for n, (cmd, res) in enumerate(zip(commands, results)):
        want = block.exit_code if n == len(commands) - 1 else 0
        assert res.returncode == want, (
            f"{block.id}: `{cmd.line}` exited {res.returncode}, docs expect {want}\n{res.output}"
        )
        got = _norm(res.output)
        for line in cmd.expected:
            shown = _norm(line.replace(DOCS_TMP, str(tmp)))
            if not shown or shown.startswith("..."):
                continue
            assert shown in got, (
                f"{block.id}: `{cmd.line}` did not print the line the docs show:\n  {line}\nit printed:\n{res.output}"
            )


# ---- docs/cli.md names only options that exist ------------------------------------------------

CLI_DOC = ROOT / "docs" / "cli.md"
COMMANDS = sorted(__import__("ckptkit_cli.main", fromlist=["cli"]).cli.commands)  # every command must be documented
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def cli_sections() -> dict[str, str]:
    """The text of each `## ckptkit <command>` section of docs/cli.md ("" = global options)."""
    text = CLI_DOC.read_text(encoding="utf-8")
    sections: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip().strip("`")
            if title.lower() == "global options":
                current = ""
            elif title.startswith("ckptkit ") and len(title.split()) == 2:
                current = title.split()[1]
            else:
                current = None
            if current is not None:
                sections.setdefault(current, "")
            continue
        if current is not None and not line.startswith("$ "):
            sections[current] += line + "\n"
    return sections


def help_options(*args: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "ckptkit", *args, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr
    options_part = out.stdout.split("Options:", 1)[1].split("Commands:", 1)[0]
    return set(OPTION.findall(options_part))


@pytest.fixture(scope="module")
def helps() -> dict[str, set[str]]:
    names = [""] + COMMANDS
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        found = list(pool.map(lambda c: help_options(*([c] if c else [])), names))
    return dict(zip(names, found))


def test_cli_doc_has_a_section_per_command():
    sections = cli_sections()
    for cmd in [""] + COMMANDS:
        assert cmd in sections, f"docs/cli.md has no section for {'global options' if not cmd else cmd}"


@pytest.mark.parametrize("cmd", [""] + COMMANDS, ids=["global"] + COMMANDS)
def test_cli_doc_options_exist(cmd, helps):
    mentioned = set(OPTION.findall(cli_sections()[cmd]))
    unknown = mentioned - helps[cmd] - {"--help"}
    assert not unknown, f"docs/cli.md names {sorted(unknown)} for `ckptkit {cmd}`, which --help does not list"


@pytest.mark.parametrize("cmd", [""] + COMMANDS, ids=["global"] + COMMANDS)
def test_cli_doc_covers_every_option(cmd, helps):
    mentioned = set(OPTION.findall(cli_sections()[cmd]))
    missing = helps[cmd] - mentioned - {"--help"}
    assert not missing, f"docs/cli.md does not document {sorted(missing)} of `ckptkit {cmd}`"


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_example_options_exist(block: Block, helps):
    """Every option an example passes exists for that command (or globally, before it)."""
    for cmd in block.commands:
        if not cmd.runs:
            continue
        args = shlex.split(cmd.line)[1:]
        name = next((a for a in args if not a.startswith("-")), "")
        pos = args.index(name) if name else len(args)
        for a in args[:pos]:
            if a.startswith("--"):
                assert a in helps[""], f"{block.id}: global option {a} does not exist"
        for a in args[pos + 1 :]:
            if a.startswith("--"):
                assert a.split("=")[0] in helps.get(name, set()), f"{block.id}: `ckptkit {name}` has no option {a}"


# ---- every command's --help shows 1-3 examples, and they run ------------------------------------
# An example is a line `$ ckptkit ...` after `Examples:` in a command's --help (cli/main.py
# `examples`). Examples name their inputs with the placeholders below (listed in the top-level
# help); the test runs a command's examples in order in a fresh folder where each placeholder is
# a link to a fixture, so their outputs land there. `ckptkit demo` is not run (it trains a model).

HELP_INPUTS = {
    "dcp_ckpt": "fixtures/data/fsdp2_w2",
    "dcp_ckpt_w3": "fixtures/data/fsdp2_w3",
    "ds_ckpt": "fixtures/data/deepspeed/z3_bf16_w2",
    "state_dict.pt": "fixtures/data/plain_state_dict.pt",
    "ds_config.json": "fixtures/data/deepspeed/z2_fp32_w2/ds_config.json",
}
EXAMPLE_EXIT = {"diff": (0, 1)}  # diff's 1 means "not equal", which an example may show


def help_text(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "ckptkit", *args, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="80"),
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def help_examples(text: str) -> list[str]:
    """The `$ ckptkit ...` lines of a help text's Examples section, without the `$ `."""
    lines = text.split("Examples:", 1)[1].splitlines() if "Examples:" in text else []
    return [ln.strip()[2:] for ln in lines if ln.strip().startswith("$ ckptkit ")]


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    names = [""] + COMMANDS
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return dict(zip(names, pool.map(lambda c: help_text(*([c] if c else [])), names)))


def test_top_level_help_lists_every_command_on_one_line(help_texts):
    listed = help_texts[""].split("Commands:", 1)[1].split("\n\n", 1)[0].splitlines()
    names = [ln.split()[0] for ln in listed if ln.strip()]
    assert names == COMMANDS, listed
    assert all(len(ln.split(None, 1)) == 2 and not ln.startswith("    ") for ln in listed if ln.strip()), listed
    for name in HELP_INPUTS:  # the placeholders the examples use are explained
        assert name in " ".join(help_texts[""].split()), name


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_examples_run(cmd, help_texts, tmp_path):
    examples = help_examples(help_texts[cmd])
    assert 1 <= len(examples) <= 3, f"`ckptkit {cmd} --help` shows {len(examples)} examples; it needs 1-3"
    for line in examples:
        assert shlex.split(line)[1] == cmd, f"`ckptkit {cmd} --help` shows an example of another command: {line}"
    if cmd == "demo":
        return  # shown, not run: it trains a model on 2 processes
    for name, target in HELP_INPUTS.items():
        os.symlink(ROOT / target, tmp_path / name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for line in examples:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptkit", *shlex.split(line)[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode in EXAMPLE_EXIT.get(cmd, (0,)), (
            f"`{line}` (from `ckptkit {cmd} --help`) exited {proc.returncode}\n{proc.stdout}{proc.stderr}"
        )
        assert "error" not in proc.stderr.lower(), f"`{line}`: {proc.stderr}"
