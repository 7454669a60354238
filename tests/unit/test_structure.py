"""The library's rooms stay small and point one way (issue 57): no library file over ~450 lines, no function over ~80
but the copy kernel, no import cycle among the library's modules, counting the imports made inside functions (a cycle
hidden there is still a cycle), and every module docstring of the code one paragraph (a command line's usage block may
follow it). The Markdown budget and the documented paths are checked in tests/unit/test_readme.py."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The installed package's folders (setup.cfg's package_dir): kernels/ is triton_offload.kernels, connector/ is
# triton_offload.connector.
PACKAGES = {
    "triton_offload": "triton_offload",
    "kernels": "triton_offload.kernels",
    "connector": "triton_offload.connector",
}
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
# The copy kernel is one function by design (docs/design.md, section 5): Triton inlines its helpers anyway.
LONG_FUNCTIONS_ALLOWED = {"kernels/copy_blocks.py:_copy_blocks_kernel"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_library_file_is_over_the_limit(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{MODULES[name].relative_to(ROOT)}: {lines} lines (limit {MAX_FILE_LINES})"


def test_no_library_function_is_over_the_limit():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(ROOT)}:{node.name}"
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and where not in LONG_FUNCTIONS_ALLOWED:
                    long.append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports under ``if TYPE_CHECKING:`` (never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The library modules ``name`` imports, at any depth of its code (``from pkg import mod`` counts ``pkg.mod``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative
                package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], node.module])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES and m != name}


def test_the_library_has_no_import_cycle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    # A package's __init__ re-exporting its modules is no cycle of theirs: leave the package nodes out.
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    graph = {n: deps - packages for n, deps in graph.items() if n not in packages}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_an_import_made_inside_a_function(tmp_path, monkeypatch):
    """The check is not vacuous: a function-level import back to an importer is found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import triton_offload.b\n")
    b.write_text("def f():\n    from triton_offload import a\n")
    monkeypatch.setitem(MODULES, "triton_offload.a", a)
    monkeypatch.setitem(MODULES, "triton_offload.b", b)
    assert "triton_offload.a" in _imports("triton_offload.b", b)
    with pytest.raises(AssertionError, match="triton_offload.a -> triton_offload.b -> triton_offload.a"):
        test_the_library_has_no_import_cycle()


# Module docstrings (issue 57): ONE paragraph, saying what the module is for, its entry points and what is not obvious;
# details go to the docstring of the class or function they belong to. A command-line module may add, after one blank
# line, a usage block: command lines indented by 4 spaces (``    python -m bench.micro.call_cost [--json PATH]``, a
# continuation line indented further), and nothing after it.
DOCSTRING_FOLDERS = ("triton_offload", "kernels", "connector", "bench", "tools")
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_COMMAND = re.compile(r" {4}(?:python3? |\./)")


def _docstring_modules() -> list[pathlib.Path]:
    return [path for folder in DOCSTRING_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]


def docstring_problem(doc: str) -> str | None:
    """Why a module docstring is not one paragraph, optionally followed by a usage block; None where it is."""
    parts = _BLANK_LINE.split(doc.strip())
    if len(parts) == 1:
        return None
    usage = parts[1].splitlines()
    if len(parts) == 2 and _COMMAND.match(usage[0]) and all(line.startswith("    ") for line in usage):
        return None
    return f"{len(parts)} paragraphs; the one paragraph may be followed only by a usage block of command lines"


def check_module_docstrings(paths: list[pathlib.Path]) -> None:
    wrong = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        problem = doc and docstring_problem(doc)
        if problem:
            wrong.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {problem}")
    assert not wrong, "module docstrings not one paragraph: " + "; ".join(wrong)


def test_every_module_docstring_is_one_paragraph():
    paths = _docstring_modules()
    assert len(paths) >= 100, "the folders no longer hold the code"
    check_module_docstrings(paths)


def test_the_docstring_check_refuses_a_second_paragraph(tmp_path):
    """The check is not vacuous: a second paragraph of prose is refused, and so are prose after a usage block, a usage
    block two blank lines down and indented prose; one paragraph and a usage block pass."""
    usage = tmp_path / "usage.py"
    usage.write_text('"""What it does.\n\n    python -m tool [--json PATH]\n            [--more]\n"""\n')
    check_module_docstrings([usage])
    for name, doc in {
        "two.py": "What it does.\n\nAnd a second paragraph of details.\n",
        "after.py": "What it does.\n\n    python -m tool\n\nMore details.\n",
        "gap.py": "What it does.\n\n\n    python -m tool\n",
        "indented.py": "What it does.\n\n    Details indented as if they were commands.\n",
    }.items():
        path = tmp_path / name
        path.write_text(f'"""{doc}"""\n')
        with pytest.raises(AssertionError, match=f"{name}: .*paragraphs"):
            check_module_docstrings([path])
