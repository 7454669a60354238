"""What the README and the docs say, checked: their Python examples run as written (on CPU, through the
interpreter), the vLLM examples build their engine under a main guard, the README stays a short read that names the
commands and the code it measured, the recipes the end-to-end tests read from docs/tiering.md agree with how the
tests run them, every path, module, section and configuration key the docs name exists (or is named), and the
Markdown stays within its size. (The README's quick start itself runs in tests/e2e/test_readme_quickstart.py.)"""

import ast
import json
import os
import pathlib
import re
import shlex
import subprocess

from doc_recipes import README, ROOT, TIERING, block, recipe_env, recipe_json

LIBRARY = ROOT / "docs" / "library.md"
VLLM_DOC = ROOT / "docs" / "vllm.md"
# Issue 57's limits, in bytes (1 kB = 1000 bytes).
MARKDOWN_LIMIT = 140_000
BENCHMARK_DOC_LIMIT = 25_000
# The folders of the checkout whose paths the docs name.
FOLDERS = ("triton_offload", "kernels", "connector", "bench", "tools", "tests", "docs", r"\.ci")


def _markdown() -> list[pathlib.Path]:
    """Every Markdown file of the checkout, outside hidden and build folders (virtual environments, bundles)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__")]
        dirs[:] = [d for d in dirs if not d.endswith(".egg-info")]
        found += [pathlib.Path(folder) / f for f in files if f.endswith(".md")]
    return sorted(found)


MARKDOWN = _markdown()


def test_library_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", LIBRARY.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(LIBRARY), "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["engine"]._tracker._closed, "the example shuts its engine down"
    assert namespace["cache"].buffer is None and namespace["cache1"].buffer is None, "the examples close their caches"


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def test_vllm_examples_build_the_engine_under_a_main_guard():
    """vLLM starts its processes with spawn (always on its CPU build), which imports the main module again: an
    example that builds ``LLM(...)`` at module level would make every such process build another engine."""
    checked = 0
    for doc in (README, VLLM_DOC, TIERING):
        for code in (b for b in re.findall(r"```py\n(.*?)```", doc.read_text(), re.S) if "LLM(" in b):
            checked += 1
            for stmt in ast.parse(code).body:
                if _is_main_guard(stmt):
                    continue
                calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "LLM"]
                assert not calls, f"{doc.name}: LLM(...) built at module level, outside the main guard:\n{code}"
    assert checked >= 2, "the docs lost their vLLM examples"


def test_the_readme_is_a_short_read_that_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes: move detail to docs/"
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert [line.split()[:2] for line in first] == [["./dev", "bench"], ["./dev", "test"]]
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+)\)", text):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_the_benchmarks_readme_points_to_the_benchmark_doc():
    """bench/README.md is a pointer: the benchmarks are documented in one file, docs/benchmarks.md."""
    text = (ROOT / "bench" / "README.md").read_text()
    assert len(text.encode()) <= 1500, "bench/README.md points to docs/benchmarks.md: move detail there"
    assert "](../docs/benchmarks.md)" in text


def test_the_markdown_stays_short():
    """The docs are a short read (issue 57: at most 140 kB of Markdown in all, the benchmarks in one file of at most
    25 kB): a page that grows takes its bytes from another, or from what the code's docstrings already say."""
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_bytes()) for path in MARKDOWN}
    assert sum(sizes.values()) <= MARKDOWN_LIMIT, f"{sum(sizes.values())} bytes of Markdown: {sizes}"
    assert sizes["docs/benchmarks.md"] <= BENCHMARK_DOC_LIMIT, sizes["docs/benchmarks.md"]


def _named_paths(path: pathlib.Path) -> set[str]:
    """The repository paths a Markdown file names: links (relative to the file), paths under the repository's
    folders (in backticks, tables or prose; a glob or a ``file::test`` id counts as its path), and modules run with
    ``python -m``, as files."""
    text = path.read_text()
    named = set()
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)  # code such as kernel[grid](...) is no link
    for link in re.findall(r"\]\(([^)\s#:]+)", prose):
        named.add((path.parent / link).resolve().relative_to(ROOT).as_posix())
    named.update(re.findall(rf"(?<![\w/.-])(?:{'|'.join(FOLDERS)})/[\w*/.-]*[\w*]", text))
    for module in re.findall(r"python -m ((?:bench|tools)(?:\.[a-z_][a-z0-9_]*)+)(?![\w.])", text):
        named.add(module.replace(".", "/") + "{.py,/__main__.py}")
    return named


def _exists(name: str) -> bool:
    if "{" in name:  # a module run with python -m: a file, or a package's __main__
        stem, options = name.split("{")
        return any((ROOT / (stem + option)).exists() for option in options.rstrip("}").split(","))
    return any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()


def test_every_path_the_docs_name_exists():
    """Every repository path a Markdown file names exists (a file that moves takes its mentions with it)."""
    named = {(path.relative_to(ROOT).as_posix(), name) for path in MARKDOWN for name in _named_paths(path)}
    assert len(named) >= 100, "the path pattern no longer finds the docs' paths"
    missing = sorted((source, name) for source, name in named if not _exists(name))
    assert not missing, f"named but not there (doc, path): {missing}"


def test_the_test_files_the_sources_name_exist():
    """Every path under tests/ that ``dev``, setup.cfg or the code's comments name (a test file, a folder of a kind, a
    ``test_bench_*.py`` glob) exists; the docs' paths are the test above's."""
    sources = [ROOT / "dev", ROOT / "setup.cfg"]
    for package in ("triton_offload", "kernels", "connector", "bench", "tools"):
        sources += sorted(p for p in (ROOT / package).rglob("*.py") if "results" not in p.parts)
    named = {
        (path.relative_to(ROOT).as_posix(), m)
        for path in sources
        for m in re.findall(r"(?<![\w/.-])tests/[\w*/.-]*[\w*]", path.read_text())
    }
    assert len(named) >= 10, "the code lost its references to the tests"
    missing = sorted((source, name) for source, name in named if not any(ROOT.glob(name)))
    assert not missing, f"named but not there (source, path): {missing}"


def _module_exists(dotted: str) -> bool:
    """``triton_offload.x.y`` (``bench.``, ``tools.``) names a module: each dotted part down to the first module
    file is a package or that file; what follows a module file is an attribute, not checked."""
    parts = dotted.split(".")
    if parts[0] == "triton_offload" and len(parts) > 1 and parts[1] in ("kernels", "connector"):
        parts = parts[1:]  # installed under the package, kept at the top of the checkout (setup.cfg)
    folder = ROOT / parts[0]
    for part in parts[1:]:
        if (folder / f"{part}.py").is_file():
            return True
        if not (folder / part / "__init__.py").is_file():
            return False
        folder = folder / part
    return True


def test_every_module_the_docs_name_exists():
    """Every dotted module the docs name (``triton_offload.connector.p2p_tier``, ``bench.common.results``, ...)
    exists: a recipe's ``module_path`` is imported by vLLM as written."""
    named = {
        (path.relative_to(ROOT).as_posix(), m)
        for path in MARKDOWN
        for m in re.findall(r"(?<![\w/.-])(?:triton_offload|bench|tools)(?:\.[a-z_][a-z0-9_]*)+", path.read_text())
    }
    assert len(named) >= 10
    missing = sorted((source, name) for source, name in named if not _module_exists(name))
    assert not missing, f"named but not there (doc, module): {missing}"


def _headings(doc: pathlib.Path) -> list[str]:
    """A page's section names: its headings (without their numbers) and bold lead-ins, backticks dropped."""
    text = doc.read_text()
    found = re.findall(r"^#+ (?:\d+\. )?(.+)$", text, re.M) + re.findall(r"^\*\*(.+?)\*\*", text, re.M)
    return [name.replace("`", "").lower() for name in found]


def test_the_sections_the_docs_and_sources_cite_exist():
    """A citation of a section, ``docs/design.md, "Host cost per call"`` (or the section in parentheses), in the docs
    or the code names a heading or a bold lead-in of that page: sections renamed or cut take their citations along."""
    sources = [*MARKDOWN, *sorted(p for p in ROOT.glob("tests/**/*.py"))]
    for package in ("triton_offload", "kernels", "connector", "bench", "tools"):
        sources += sorted(p for p in (ROOT / package).rglob("*.py") if "results" not in p.parts)
    cited = {
        (path.relative_to(ROOT).as_posix(), page, section)
        for path in sources
        for page, section in re.findall(r"([\w-]+\.md)\)?(?:, *| *\( *)[\"']([^\"'\n]+)[\"']", path.read_text())
    }
    assert len(cited) >= 20, "the citation pattern no longer finds the citations"
    wrong = []
    for source, page, section in sorted(cited):
        doc = ROOT / "docs" / page
        names = _headings(doc) if doc.is_file() else []
        if not any(name.startswith(section.replace("`", "").lower()) for name in names):
            wrong.append((source, page, section))
    assert not wrong, f"cited but no such section (source, page, section): {wrong}"


# The connector's key sets: every key either spec reads (theirs and vLLM's), wherever in connector/ they are defined.
KEY_SETS = ("OUR_KEYS", "VLLM_KEYS", "TIERING_KEYS", "OUR_TIERING_KEYS", "UNKNOWN_KEYS")


def _config_keys() -> dict[str, set[str]]:
    """The keys of each of KEY_SETS, read from connector/'s sources (a set or dict literal, ``frozenset({...})``, or
    one string), without importing them (the tiering spec's module imports vLLM)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "connector").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets][0] in KEY_SETS:
                value = node.value.args[0] if isinstance(node.value, ast.Call) else node.value
                keys = ast.literal_eval(value)
                found[node.targets[0].id] = {keys} if isinstance(keys, str) else set(keys)
    return found


def test_every_configuration_key_is_documented():
    """Every key of kv_connector_extra_config either spec reads is named (in backticks) in the plugin's docs."""
    found = _config_keys()
    assert set(found) == set(KEY_SETS), f"key sets not found in connector/: {set(KEY_SETS) - set(found)}"
    docs = "".join((ROOT / "docs" / page).read_text() for page in ("vllm.md", "tiering.md", "host-memory.md"))
    missing = sorted(key for keys in found.values() for key in keys if f"`{key}`" not in docs)
    assert not missing, f"configuration keys the docs do not name: {missing}"


def test_the_readme_json_line_is_the_quick_starts_configuration_and_valid():
    """The one JSON line is the configuration the quick start runs, but for the budget (the quick start's is small)."""
    text = README.read_text()
    line = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    server = block("quickstart:server", README)
    quick = json.loads(re.search(r"--kv-transfer-config '(.*?)'", server, re.S).group(1))
    assert {**line["kv_connector_extra_config"], "cpu_bytes_to_use": "1GiB"} == quick["kv_connector_extra_config"]
    assert {k: v for k, v in line.items() if k != "kv_connector_extra_config"} == {
        k: v for k, v in quick.items() if k != "kv_connector_extra_config"
    }


def test_the_readme_names_the_supported_vllm_versions_per_feature():
    """The README's version table: a row per feature, a column per vLLM version; MultiConnector refused on 0.32."""
    text = README.read_text().split("## Install into your vLLM environment", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| feature | vLLM 0.32 | vLLM 0.33 |"
    multi = next(row for row in rows if "MultiConnector" in row)
    assert "refused at startup" in multi.split("|")[2] and multi.split("|")[3].strip() == "yes"
    assert "## vLLM versions" in VLLM_DOC.read_text()


def _ran(named: str, recorded, dirty) -> bool:
    """Whether a results file recording ``recorded`` (and ``dirty``) can be of commit ``named``: the same commit, or,
    dirty, one of its ancestors (the GPU machine's git may know only an older commit: its working tree is the newer
    one's). Without git history (an archive) only the first."""
    recorded = str(recorded or "").split("+")[0]
    if recorded and (recorded.startswith(named) or named.startswith(recorded)):
        return True
    if not dirty or not (ROOT / ".git").exists():
        return False
    ancestor = ["git", "merge-base", "--is-ancestor", recorded, named]
    return subprocess.run(ancestor, cwd=ROOT, capture_output=True).returncode == 0


def test_the_measured_table_names_its_device_date_driver_and_commit():
    """The README's measured table names the device, driver, date and commit of a run whose files are committed
    (bench/results/<device>-<date>-*, recording that driver and commit), and docs/benchmarks.md's newest section is
    that run's."""
    section = " ".join(README.read_text().split("## What it measured", 1)[1].split("\n## ", 1)[0].split())
    m = re.search(r"One (NVIDIA [\w ]+?) \(.*?driver ([\d.]+) .*?(\d{4}-\d\d-\d\d), commit ([0-9a-f]{7,40})\b", section)
    assert m, section[:300]
    device, driver, date, commit = m.groups()
    runs = []
    for path in (ROOT / "bench" / "results").glob(f"{device.lower().replace(' ', '-')}-{date}-*.json"):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("driver") == driver and _ran(commit, doc.get("commit"), doc.get("dirty")):
            runs.append(path.name)
    assert runs, f"no committed {device} results of {date} with driver {driver} and commit {commit}"
    measured = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split("## Measured", 1)[1].split())
    assert measured.startswith(f": {device}, {date}") and commit in measured


def test_the_obj_recipe_starts_the_server_the_tier_entry_names():
    """docs/tiering.md's S3 recipe: the bucket it creates, with the credentials it creates it with, at the endpoint it
    starts moto on, is what its tier entry names (the obj end-to-end test reads the tier entry and starts moto the
    same way, on a port of its own)."""
    tier = recipe_json("obj-tier")
    steps = block("recipe:obj-server").splitlines()
    assert steps[0] == "python -m pip install 'moto[s3]' flask flask-cors boto3"
    host, port = tier["store_config"]["endpoint_override"].split(":")
    assert shlex.split(steps[1]) == ["python", "-m", "moto.server", "-H", host, "-p", port, "&"]
    store = tier["store_config"]
    create = (
        f"boto3.client('s3', endpoint_url='{store['scheme']}://{host}:{port}', "
        f"aws_access_key_id='{store['access_key']}', aws_secret_access_key='{store['secret_key']}', "
        f"region_name='{store['region']}')"
        f".create_bucket(Bucket='{store['bucket']}')"
    )
    assert create in steps[2]


def test_the_p2p_recipe_is_loopback():
    """docs/tiering.md's p2p recipe, which the p2p end-to-end test reads (tier entry, request, UCX environment): the
    supported tier, bound to loopback, the request naming that instance, UCX kept to TCP on the loopback device."""
    tier, request = recipe_json("p2p-tier"), recipe_json("p2p-request")
    assert tier["type"] == "P2PTier" and tier["module_path"] == "triton_offload.connector.p2p_tier"
    assert tier["host"] == "127.0.0.1"
    assert request["remote_kv_source"]["remote_host"] == tier["host"]
    assert request["remote_kv_source"]["remote_port"] == tier["port"]
    assert recipe_env("p2p-env") == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
