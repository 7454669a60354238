"""What the README and the docs say, checked: their Python examples run as written (on CPU, through the
interpreter), the vLLM examples build their engine under a main guard, the README stays a short read that names the
commands and the code it measured, and the recipes the end-to-end tests read from docs/tiering.md agree with how the
tests run them. (The README's quick start itself runs in tests/e2e/test_readme_quickstart.py.)"""

import ast
import json
import re
import shlex

from doc_recipes import README, ROOT, TIERING, block, recipe_env, recipe_json

LIBRARY = ROOT / "docs" / "library.md"
VLLM_DOC = ROOT / "docs" / "vllm.md"


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


def test_the_benchmarks_readme_is_a_short_read_whose_links_hold():
    """bench/README.md stays an overview (the detail is docs/benchmarks.md and docs/gpu-run.md), its links and the
    modules its commands run exist."""
    bench_readme = ROOT / "bench" / "README.md"
    text = bench_readme.read_text()
    assert len(text.encode()) <= 15 * 1024, f"bench/README.md is {len(text.encode())} bytes: move detail to docs/"
    links = re.findall(r"\]\(([^)#:]+)\)", text)
    assert links and all((bench_readme.parent / link).resolve().exists() for link in links), links
    for module in set(re.findall(r"python -m ((?:bench|tools)(?:\.[a-z_]+)+)(?![\w.])", text)):
        path = ROOT.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), module


def test_the_test_files_the_docs_and_sources_name_exist():
    """Every path under tests/ that the docs, ``dev`` or the code's comments name (a test file, a folder of a kind, a
    ``test_bench_*.py`` glob) exists: tests/README.md says which folder holds what, and a file that moves takes its
    mentions with it."""
    sources = [README, ROOT / "bench" / "README.md", ROOT / "tests" / "README.md", *sorted(ROOT.glob("docs/*.md"))]
    sources += [ROOT / "dev", ROOT / "setup.cfg"]
    for package in ("triton_offload", "kernels", "connector", "bench", "tools"):
        sources += sorted(p for p in (ROOT / package).rglob("*.py") if "results" not in p.parts)
    named = {
        (path.relative_to(ROOT).as_posix(), m)
        for path in sources
        for m in re.findall(r"(?<![\w/.-])tests/[\w*/.-]*[\w*]", path.read_text())
    }
    assert len(named) >= 30, "the docs lost their references to the tests"
    missing = sorted((source, name) for source, name in named if not any(ROOT.glob(name)))
    assert not missing, f"named but not there (source, path): {missing}"


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


def test_the_measured_table_names_its_device_date_driver_and_commit():
    section = README.read_text().split("## What it measured", 1)[1].split("\n## ", 1)[0]
    for fact in ("NVIDIA H100 80GB HBM3", "2026-11-22", "driver 580.159.04", "the commit measured is not recorded"):
        assert fact in section
    assert "commit not recorded" in (ROOT / "docs" / "measured.md").read_text()


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
