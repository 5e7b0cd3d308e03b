"""The boundary of a format package, checked from the source: a format is one adapter
(formats/<format>/format.py) registered once, and nothing above the formats reaches inside one.

- the registry imports nothing from a format package but its format.py, and opens a path with
  one loop over one ordered list (no hand-ordered chain of its own);
- a format's adapter asks nothing of another format (a detect is positive: precedence is the
  registry's order), and the folder kinds import no format package;
- ops/, api.py, hooks/ and convert/ import nothing inside a format package: they ask the registry
  and the protocol (capabilities such as `reshard_targets`, `own_keys` and `saved_key_order`, the
  index's typed `replicas`; the neutral types they build layouts of live in index/ or storage/);
- no module of formats/ (DeepSpeed's package aside, whose layout model is its own), ops/, api.py
  or hooks/ uses another module's private (`_name`) names, nor an object's private attribute
  other than its own class's through `self`/`cls`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ckptkit"
FORMATS = PKG / "formats"
FORMAT_PACKAGES = sorted(p.name for p in FORMATS.iterdir() if (p / "format.py").is_file())
ABOVE_FORMATS = ("ckptkit/ops/", "ckptkit/hooks/", "ckptkit/api.py", "ckptkit/convert/")
PRIVATE_SCOPE = ("ckptkit/formats/", "ckptkit/ops/", "ckptkit/hooks/", "ckptkit/api.py")
PRIVATE_EXCLUDED = ("ckptkit/formats/deepspeed/",)

# the standard library's own private attributes, used where it offers no public way
STDLIB_PRIVATE = {
    # a zip member written by ckptkit's kernel copy: zipfile.ZipInfo keeps its CRC and sizes here
    ("ckptkit/formats/torch_save/archive_writer.py", "_crc"),
    ("ckptkit/formats/torch_save/archive_writer.py", "_file_size"),
    ("ckptkit/formats/torch_save/archive_writer.py", "_compress_size"),
}
# torch's own private attributes, used where it offers no public way
TORCH_PRIVATE = {
    # a tensor's version counter, which every in-place change moves (autograd's own check):
    # an async save's deferred copy refuses a tensor changed before the copy was made
    ("ckptkit/hooks/staging.py", "_version"),
}
# private names still shared, each with what removes it; an entry no longer found fails
# test_known_private_uses_still_exist: remove it then
KNOWN_PRIVATE: set[tuple[str, str]] = set()
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in `path`, relative ones resolved; `from m import x` gives m.x."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _inside_format(name: str) -> str | None:
    """The format package `name` reaches into (`ckptkit.formats.dcp.reader` -> "dcp"), else None."""
    parts = name.split(".")
    if parts[:2] == ["ckptkit", "formats"] and len(parts) > 2 and parts[2] in FORMAT_PACKAGES:
        return parts[2]
    return None


def _sources(prefixes: tuple[str, ...], excluded: tuple[str, ...] = ()) -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if _rel(p).startswith(prefixes) and not _rel(p).startswith(excluded)]


def test_the_format_packages_are_found():
    assert FORMAT_PACKAGES == ["dcp", "deepspeed", "ds_universal", "mcore", "safetensors", "torch_save"]


def test_ops_api_hooks_and_convert_import_nothing_inside_a_format_package():
    wrong = [
        f"{_rel(p)}:{line}: imports {name}"
        for p in _sources(ABOVE_FORMATS)
        for line, name in imported_modules(p)
        if _inside_format(name)
    ]
    assert not wrong, "ask formats.registry and the protocol instead:\n" + "\n".join(wrong)


def test_the_registry_imports_only_each_formats_adapter():
    wrong = [
        f"{line}: {name}"
        for line, name in imported_modules(FORMATS / "registry.py")
        if _inside_format(name) and name.split(".")[3:4] != ["format"]
    ]
    assert not wrong, "formats/registry.py reaches inside a format package:\n" + "\n".join(wrong)


def test_the_folder_kinds_import_no_format_package():
    wrong = [f"{line}: {name}" for line, name in imported_modules(FORMATS / "kinds.py") if _inside_format(name)]
    assert not wrong, "formats/kinds.py: hand a folder kind the formats it is made of:\n" + "\n".join(wrong)


def test_no_adapter_asks_another_format():
    wrong = []
    for fmt in FORMAT_PACKAGES:
        for line, name in imported_modules(FORMATS / fmt / "format.py"):
            other = _inside_format(name)
            if other is not None and other != fmt:
                wrong.append(f"formats/{fmt}/format.py:{line}: imports {name}")
    assert not wrong, "a detect is positive only; precedence is registry.ORDER:\n" + "\n".join(wrong)


def test_open_checkpoint_is_one_loop_over_one_list():
    tree = ast.parse((FORMATS / "registry.py").read_text())
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not functions & {"_open_folder", "_open_file"}, "a hand-ordered chain is back in the registry"
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_open_from")
    assert "ORDER" in {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)}


def test_operations_ask_capabilities_not_attributes():
    wrong = []
    for p in _sources(ABOVE_FORMATS):
        text = p.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            if "replica_entries" in line or ("hasattr(fmt" in line) or ("getattr(fmt" in line):
                wrong.append(f"{_rel(p)}:{i}: {line.strip()}")
    assert not wrong, "declare it (Capabilities, index.replicas) instead of probing for it:\n" + "\n".join(wrong)


def _private_uses(path: Path) -> set[tuple[int, str]]:
    """(line, name) of the private names `path` takes from elsewhere: imported by name, or an
    attribute of anything but `self` / `cls`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            found |= {(node.lineno, a.name) for a in node.names if _is_private(a.name)}
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in NAMEDTUPLE_API:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add((node.lineno, node.attr))
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_uses_another_modules_private_names():
    wrong = []
    for p in _sources(PRIVATE_SCOPE, PRIVATE_EXCLUDED):
        for line, name in sorted(_private_uses(p)):
            if (_rel(p), name) not in STDLIB_PRIVATE | TORCH_PRIVATE | KNOWN_PRIVATE:
                wrong.append(f"{_rel(p)}:{line}: {name}")
    assert not wrong, "a name another module needs is public (rename it without the underscore):\n" + "\n".join(wrong)


def test_known_private_uses_still_exist():  # (none now: kept for the next one)
    found = {(_rel(p), name) for p in _sources(PRIVATE_SCOPE, PRIVATE_EXCLUDED) for _, name in _private_uses(p)}
    gone = sorted(KNOWN_PRIVATE - found)
    assert not gone, f"fixed: remove from KNOWN_PRIVATE {gone}"
