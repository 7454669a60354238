"""The README's Python examples run as written (on CPU, through the interpreter)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["engine"]._closed
    assert namespace["cache"].buffer is None and namespace["cache1"].buffer is None, "the examples close their caches"
