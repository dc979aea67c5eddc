"""No import cycle among mhla_convert's modules: what each module imports as it loads (module level, not inside
functions nor under `if TYPE_CHECKING:`), read from the source with `ast`, forms no circle. A package's
`__init__` importing its submodules counts like any other module's imports. The kernels, which import the
operators to register, load only once the dispatch first needs them."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = "mhla_convert"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _loading_statements(body: list[ast.stmt]):
    """The statements that run as a module loads: into `if`/`try`/`with`/loops/class bodies, not functions, nor the
    body of `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _loading_statements(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _loading_statements(getattr(node, field, []))
        for case in getattr(node, "cases", []):
            yield from _loading_statements(case.body)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that loading module `name` loads directly: each imported module and the packages above
    it that are not already loading as `name`'s own parents."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in _loading_statements(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets.append(base)
            targets += [f"{base}.{alias.name}" for alias in node.names]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    edges = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix not in ancestors and prefix != name:
                edges.add(prefix)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        start = min(component)
        paths, seen = {start: [start]}, {start}
        queue = [start]
        while queue:  # the shortest way back to start within the component
            node = queue.pop(0)
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    cycles.append([*paths[node], start])
                    queue = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    paths[nxt] = [*paths[node], nxt]
                    queue.append(nxt)
    return cycles


def test_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_reads_relative_and_absolute_module_level_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom . import b\nfrom .c import x\nimport mhla_convert.d.e\n"
                      "if TYPE_CHECKING:\n    from . import f\ndef g():\n    from . import f\n")
    modules = dict.fromkeys(["mhla_convert", "mhla_convert.p", "mhla_convert.p.b", "mhla_convert.p.c",
                             "mhla_convert.d", "mhla_convert.d.e", "mhla_convert.p.f"], source)
    assert _imports("mhla_convert.p.mod", source, modules) == {"mhla_convert.p.b", "mhla_convert.p.c",
                                                               "mhla_convert.d", "mhla_convert.d.e"}


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_kernels_load_on_first_use_and_register_through_the_dispatch():
    """The kernels import `ops.dispatch` to register; the dispatch imports them only when a backend is first asked
    for, so importing the operators and the layer loads no kernel."""
    code = textwrap.dedent("""
        import json, sys
        import mhla_convert.layer, mhla_convert.ops
        before = "mhla_convert.kernels" in sys.modules
        from mhla_convert.ops.dispatch import available_backends
        backends = available_backends()
        print("RESULT", json.dumps([before, "mhla_convert.kernels" in sys.modules, backends]))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=600,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and "RESULT" in result.stdout, result.stdout + result.stderr
    before, after, backends = json.loads(result.stdout.split("RESULT", 1)[1])
    assert not before
    assert after == ("triton" in backends) == (importlib.util.find_spec("triton") is not None)
