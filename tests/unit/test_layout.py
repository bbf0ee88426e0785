"""The package layout holds: dflash/'s imports (module level and inside functions) have no circle,
no module imports a subpackage of a higher layer, no library module imports a command, and the top
level holds the subpackages plus at most four modules. Read with ast; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

DFLASH = Path(__file__).resolve().parents[2] / "dflash"

# Lowest first; a module may import its own subpackage and those of a lower rank (dflash/__init__.py).
RANK = {"util": 0, "nn": 0, "target": 1, "data": 2, "demo": 3, "drafter": 4, "placement": 5, "config": 6, "eval": 7,
        "training": 8, "benchmarks": 9, "tools": 9, "regenerate": 10, "report": 10}


def modules() -> dict[str, Path]:
    out = {}
    for path in DFLASH.rglob("*.py"):
        rel = path.relative_to(DFLASH.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def is_command(tree: ast.Module, path: Path) -> bool:
    return path.name == "__main__.py" or any(
        isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__" for node in tree.body)


def imports(tree: ast.Module, mods: dict[str, Path]) -> set[str]:
    """dflash modules imported anywhere in the module (outside `if TYPE_CHECKING:`), with the packages
    whose __init__ such an import runs."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", "") ==
            "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            out |= {".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in mods}
    return out


def graph() -> tuple[dict[str, set[str]], set[str]]:
    mods = modules()
    edges, commands = {}, set()
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        # a module inside a package runs within that package's import: no edge back to it
        edges[name] = {t for t in imports(tree, mods) if t != name and not name.startswith(t + ".")}
        if is_command(tree, path):
            commands.add(name)
    return edges, commands


def layer(module: str) -> str:
    return module.split(".")[1]


def test_no_import_circle():
    edges, _ = graph()
    done, on_path, circles = set(), [], []

    def visit(module: str) -> None:
        on_path.append(module)
        for nxt in sorted(edges[module]):
            if nxt in on_path:
                circles.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in done and nxt not in on_path:
                visit(nxt)
        on_path.pop()
        done.add(module)

    for module in sorted(edges):
        if module not in done:
            visit(module)
    assert not circles, circles


def test_no_module_imports_a_higher_layer():
    edges, _ = graph()
    assert set(layer(m) for m in edges if m != "dflash") <= set(RANK), "a new subpackage: give it a rank in RANK"
    upward = [(m, t) for m, targets in edges.items() for t in targets
              if m != "dflash" and t != "dflash" and layer(m) != layer(t) and RANK[layer(t)] >= RANK[layer(m)]]
    assert not upward, upward


def test_no_library_module_imports_a_command():
    edges, commands = graph()
    bad = [(m, t) for m, targets in edges.items() if m not in commands for t in targets if t in commands]
    assert not bad, bad


def test_the_top_level_holds_subpackages_and_at_most_four_modules():
    top = [p.name for p in DFLASH.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 4, top
    for package in DFLASH.iterdir():
        if package.is_dir() and package.name != "__pycache__":
            init = package / "__init__.py"
            assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{package}: docstring"


def test_the_package_holds_no_weights_or_data_files():
    """Code only: the demo's target and data live in assets/demo/, beside the package."""
    from dflash.demo import DEMO_TARGET_DIR

    heavy = [p for p in DFLASH.rglob("*") if p.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".jsonl", ".png")]
    assert not heavy, heavy
    assert DFLASH.resolve() not in DEMO_TARGET_DIR.resolve().parents and (DEMO_TARGET_DIR / "config.json").is_file()


def test_no_function_is_longer_than_sixty_lines():
    """A function a newcomer reads in one screen: its docstring counts, its decorators do not."""
    long = [f"{path.relative_to(DFLASH.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in DFLASH.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long
