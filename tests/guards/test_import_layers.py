"""ckptkit's import layers, checked from the source: no module imports a layer above its own, and
the module import graph has no cycle.

Every import counts: at module level, inside functions (deferred for startup time), and under
TYPE_CHECKING. Only third-party modules (torch through ckptkit.lazy_torch, numpy, click) are
outside the graph. Importing `a.b.c` also runs the package `a.b`'s __init__, so the cycle check
adds an edge to each enclosing subpackage the importer is not itself in (the top-level packages
`ckptkit` and `cli` excepted: every module would reach them, and ckptkit's own __init__ imports
only inside `__getattr__`).

LAYERS is the documented table (docs/architecture.md cites it), bottom to top. A module belongs to
the layer of its longest matching prefix; a module may import its own layer or any layer below.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # plain values and settings every layer uses; index.dtypes and index.strides are tables and
    # arithmetic on shapes that the stand-ins below the index need, with no index types
    (
        "foundation",
        (
            "ckptkit.errors",
            "ckptkit.framework_errors",
            "ckptkit.text",
            "ckptkit.knobs",
            "ckptkit.lazy_torch",
            "ckptkit.progress",
            "ckptkit.interrupts",
            "ckptkit.optim_state",
            "ckptkit.runner.limits",
            "ckptkit.safe_json",
            "ckptkit.regex_guard",
            "ckptkit.index.dtypes",
            "ckptkit.index.strides",
            # split rules read by the DeepSpeed reader: names and files only, no index types
            "ckptkit.convert.tp_rules",
        ),
    ),
    # what unpickling builds (stand-ins of torch's and foreign types) and the unpickler itself
    (
        "values",
        (
            "ckptkit.torch_types",
            # the package: stand-ins of foreign classes (inert), tensor references (refs), the
            # grammar's vocabulary (rules), the pickle machine (vm), the grammar (grammar, numpy),
            # the fenced C roads (keys, fence, dcp, torchsave), and the facade that re-exports them
            "ckptkit.safeload",
            "ckptkit.repickle",
        ),
    ),
    ("index", ("ckptkit.index",)),  # the canonical index and its geometry
    # the process group: an output folder of a distributed job takes part in its collectives
    ("process group", ("ckptkit.runner.distributed",)),
    ("storage", ("ckptkit.storage",)),  # sources and outputs
    ("runner", ("ckptkit.runner", "ckptkit.context")),  # fetcher, executor, process group, RunContext
    ("formats", ("ckptkit.formats",)),  # readers and writers, the registry
    ("convert", ("ckptkit.convert",)),  # the canonical training state and backend conversion
    ("ops", ("ckptkit.ops",)),  # inspect, verify, consolidate, reshard, convert, diff
    ("api", ("ckptkit.api",)),  # ckptkit.save / ckptkit.load
    ("hooks", ("ckptkit.hooks",)),  # the training-loop Checkpointer
    ("package", ("ckptkit",)),  # the package's public face (lazy)
    ("demo", ("ckptkit.demo",)),
    ("cli", ("cli", "ckptkit.__main__")),  # the click application (installed as ckptkit_cli)
]

# Imports known to go against the layers or to close a cycle, each with who fixes it. An entry
# whose import is gone fails test_expected_exceptions_still_exist: remove it then.
EXPECTED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted([*(ROOT / "ckptkit").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that `name` (a module or a name inside one) is, or None (third party)."""
    if name == "ckptkit_cli" or name.startswith("ckptkit_cli."):
        name = "cli" + name[len("ckptkit_cli") :]
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> dict[str, int]:
    """Every module of ours that `module` imports, anywhere in its source, with a line that does."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            names = [
                f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") == f"{base}.{a.name}" else base for a in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return rank


def _graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs, EXPECTED imports left out."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        edges = graph.setdefault(module, set())
        for target in imports_of(module):
            if (module, target) in EXPECTED:
                continue
            edges.add(target)
            parent = target.rpartition(".")[0]
            while "." in parent:  # the enclosing subpackages' __init__ run first (the importer's own have run)
                if parent != module and not module.startswith(parent + "."):
                    edges.add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    wrong = []
    for module in MODULES:
        for target, line in imports_of(module).items():
            if layer_of(target) > layer_of(module) and (module, target) not in EXPECTED:
                wrong.append(
                    f"{MODULES[module].relative_to(ROOT)}:{line}: {module} "
                    f"({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_import_cycle():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_expected_exceptions_still_exist():
    gone = [f"{a} -> {b}" for a, b in EXPECTED if a not in MODULES or b not in imports_of(a)]
    assert not gone, "these imports are gone: remove them from EXPECTED: " + ", ".join(gone)


def test_the_checker_sees_deferred_and_type_checking_imports(tmp_path, monkeypatch):
    """The checker itself: an import under TYPE_CHECKING and one inside a function are edges."""
    src = tmp_path / "ckptkit" / "index"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "types.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..ops import verify\n")
    (src / "geometry.py").write_text("def f():\n    from .types import Box\n")
    (tmp_path / "ckptkit" / "ops").mkdir()
    (tmp_path / "ckptkit" / "ops" / "__init__.py").write_text("")
    (tmp_path / "ckptkit" / "ops" / "verify.py").write_text("from ..index import geometry\n")
    (tmp_path / "ckptkit" / "__init__.py").write_text("")
    (tmp_path / "cli").mkdir()
    modules = {}
    for path in (tmp_path / "ckptkit").rglob("*.py"):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    assert imports_of("ckptkit.index.types") == {"ckptkit.ops.verify": 3}
    assert imports_of("ckptkit.index.geometry") == {"ckptkit.index.types": 2}
    assert find_cycle(_graph()) == [
        "ckptkit.index.geometry",
        "ckptkit.index.types",
        "ckptkit.ops.verify",
        "ckptkit.index.geometry",
    ]
