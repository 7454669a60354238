"""The recipes the documentation gives, read from it, so that the tests run what a user copies.

A recipe is the fenced code block that follows an HTML comment ``<!-- recipe:NAME -->`` (or ``<!-- NAME -->`` for the
README's ``quickstart:...`` blocks) in a Markdown file: invisible when rendered, found here by name.
"""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIERING = ROOT / "docs" / "tiering.md"
README = ROOT / "README.md"


def block(name: str, doc: pathlib.Path = TIERING) -> str:
    """The code of the fenced block marked ``<!-- name -->`` in ``doc``; fails naming the marker if there is none or
    more than one."""
    found = re.findall(rf"<!-- {re.escape(name)} -->\n```[a-z]*\n(.*?)```", doc.read_text(), re.S)
    assert len(found) == 1, f"{doc.name}: expected one block marked <!-- {name} -->, found {len(found)}"
    return found[0]


def recipe_json(name: str, doc: pathlib.Path = TIERING):
    """A ``<!-- recipe:name -->`` block of JSON, parsed."""
    return json.loads(block(f"recipe:{name}", doc))


def recipe_env(name: str, doc: pathlib.Path = TIERING) -> dict[str, str]:
    """A ``<!-- recipe:name -->`` block of one ``export NAME=value ...`` line, as a dict."""
    words = block(f"recipe:{name}", doc).split()
    assert words[0] == "export", f"recipe:{name} is not an export line"
    return dict(word.split("=", 1) for word in words[1:])
