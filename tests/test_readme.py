"""The README's Python examples run as written (on CPU, through the interpreter)."""

import ast
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["engine"]._tracker._closed, "the example shuts its engine down"
    assert namespace["cache"].buffer is None and namespace["cache1"].buffer is None, "the examples close their caches"


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def test_readme_vllm_examples_build_the_engine_under_a_main_guard():
    """vLLM starts its processes with spawn (always on its CPU build), which imports the main module again: an
    example that builds ``LLM(...)`` at module level would make every such process build another engine."""
    blocks = [b for b in re.findall(r"```py\n(.*?)```", README.read_text(), re.S) if "LLM(" in b]
    assert blocks, "the README lost its vLLM example"
    for block in blocks:
        for stmt in ast.parse(block).body:
            if _is_main_guard(stmt):
                continue
            calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "LLM"]
            assert not calls, f"LLM(...) built at module level, outside `if __name__ == '__main__':`:\n{block}"
