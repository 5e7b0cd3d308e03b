"""The package as users install it: the wheel built from this checkout holds every module and data file
of ckptkit/ and cli/ (installed as ckptkit_cli/), building it and `pip install .` print no warning, and
the `ckptkit` command runs from it in a venv that cannot see the checkout.

The clean venvs are made without pip and see this environment's site-packages through a .pth line, for
the dependencies only (torch is gigabytes): a plain path line processes no .pth file there, so the
editable install of this checkout stays invisible, and the venv's own site-packages, where the wheel
goes, comes first. Each run asserts that ckptkit and ckptkit_cli are imported from the clean venv.
Nothing here needs the network: no index (--no-index), this environment's setuptools (--no-build-isolation).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs twice: about 15 s

ROOT = Path(__file__).resolve().parent.parent.parent
# source folder -> the package it is installed as (pyproject.toml's package-dir)
PACKAGE_FOLDERS = {"ckptkit": "ckptkit", "cli": "ckptkit_cli"}
BUILD_FILES = ["pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in"]
WARNING = re.compile(r"warn|!!", re.IGNORECASE)


def package_sources() -> list[str]:
    """Every file of the package folders that a clone holds (tracked, or new and not ignored by git),
    relative to the checkout; without git, every file but byte code."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "--", *PACKAGE_FOLDERS],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = [
            str(p.relative_to(ROOT))
            for folder in PACKAGE_FOLDERS
            for p in (ROOT / folder).rglob("*")
            if "__pycache__" not in p.parts
        ]
    return sorted(name for name in listed if (ROOT / name).is_file())


def installed_name(source: str) -> str:
    """Where a source file lies inside the wheel: cli/x.py -> ckptkit_cli/x.py."""
    folder, _, rest = source.partition("/")
    return f"{PACKAGE_FOLDERS[folder]}/{rest}"


def pip_env() -> dict[str, str]:
    """This environment without what would change pip's or setuptools' output or let the checkout in:
    no PYTHONPATH, no version check notice, byte-compiling allowed (setuptools says it skips it otherwise)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip(*args: str, cwd: Path) -> str:
    """Run this environment's pip, verbose (the build backend's whole output); return stdout + stderr."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", *args, "-v"], cwd=cwd, env=pip_env(), capture_output=True, text=True, timeout=300
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"pip {' '.join(args)} failed:\n{out[-4000:]}"
    return out


def warnings_in(output: str) -> list[str]:
    return [line for line in output.splitlines() if WARNING.search(line)]


def clean_venv(path: Path) -> Path:
    """A venv without pip whose only view of this environment is its site-packages, appended after the
    venv's own (dependencies come from there; ckptkit must come from what is installed into the venv)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(own, "dependencies_of_the_test_environment.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return python


def assert_runs_from(venv: Path, workdir: Path) -> None:
    """`ckptkit --help` works from the venv's console script, and ckptkit, ckptkit_cli and the built-in
    TP rules (package data) are loaded from the venv, not from the checkout."""
    env = pip_env()
    res = subprocess.run(
        [str(venv / "bin" / "ckptkit"), "--help"], cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, f"ckptkit --help failed:\n{res.stdout}{res.stderr}"
    assert res.stdout.startswith("Usage: ckptkit"), res.stdout[:500]
    for command in ("inspect", "verify", "consolidate", "reshard", "convert", "diff", "demo"):
        assert re.search(rf"^\s+{command}\s", res.stdout, re.MULTILINE), f"--help lists no {command}:\n{res.stdout}"
    probe = (
        "import ckptkit, ckptkit_cli\n"
        "from ckptkit.convert.tp_rules import builtin_rules\n"
        "print(ckptkit.__file__); print(ckptkit_cli.__file__); print(len(builtin_rules().rules))\n"
    )
    res = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    ckptkit_file, cli_file, rules = res.stdout.split()
    site = str(venv.resolve())
    assert ckptkit_file.startswith(site) and cli_file.startswith(site), (
        f"imported from outside the clean venv: {ckptkit_file}, {cli_file}"
    )
    assert int(rules) > 0


def copy_sources(dest: Path) -> Path:
    """What a clone holds of the project's build inputs and package folders, copied out of the checkout
    (a build leaves build/ and *.egg-info behind, and stale files in build/ would reach the wheel)."""
    for name in [*BUILD_FILES, *package_sources()]:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The wheel built from a copy of the sources, and pip's verbose output of the build."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    log = pip(
        "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(copy_sources(source)), cwd=out
    )
    wheels = list(out.glob("ckptkit-*.whl"))
    assert len(wheels) == 1, f"expected one ckptkit wheel, found {wheels}"
    return wheels[0], log


def test_wheel_build_prints_no_warning(built):
    _, log = built
    assert "Successfully built ckptkit" in log
    assert not warnings_in(log), "the build warned:\n" + "\n".join(warnings_in(log))


def test_wheel_holds_every_module_and_data_file(built):
    wheel, _ = built
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    expected = {installed_name(s) for s in package_sources()}
    assert {s for s in expected if s.endswith(".py")} >= {"ckptkit/__init__.py", "ckptkit_cli/entry.py"}
    rules = {s for s in expected if s.startswith("ckptkit/convert/builtin_tp_rules/") and s.endswith(".json")}
    assert len(rules) >= 2, f"the built-in TP rules are missing from the checkout: {rules}"
    missing, extra = sorted(expected - shipped), sorted(shipped - expected)
    assert not missing, (
        "in the checkout but not in the wheel (a package setuptools did not find, or data"
        f" not declared in [tool.setuptools.package-data]): {missing}"
    )
    assert not extra, f"in the wheel but not in the checkout: {extra}"
    assert not any(n.startswith(("cli/", "tests/", "fixtures/")) for n in names)
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry_points = zipfile.ZipFile(wheel).read(info).decode()
    assert re.search(r"^ckptkit = ckptkit_cli\.entry:main$", entry_points, re.MULTILINE), entry_points


def test_ckptkit_runs_from_the_wheel_in_a_clean_venv(built, tmp_path):
    wheel, _ = built
    python = clean_venv(tmp_path / "venv")
    log = pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel), cwd=tmp_path)
    assert not warnings_in(log), "installing the wheel warned:\n" + "\n".join(warnings_in(log))
    assert_runs_from(tmp_path / "venv", tmp_path)


def test_pip_install_of_the_checkout_prints_no_warning(tmp_path):
    source = copy_sources(tmp_path / "source")
    python = clean_venv(tmp_path / "venv")
    log = pip(
        "--python", str(python), "install", "--no-deps", "--no-build-isolation", "--no-index", str(source), cwd=tmp_path
    )
    assert "Successfully installed ckptkit" in log
    assert not warnings_in(log), "pip install . warned:\n" + "\n".join(warnings_in(log))
    assert_runs_from(tmp_path / "venv", tmp_path)
