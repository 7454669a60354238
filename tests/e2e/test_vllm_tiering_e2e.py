"""End to end: two vLLM engines (CPU platform), one after the other, sharing nothing but an ``fs`` tier directory.

Engine A serves a 200-token prompt cold and exits once its chunks have cascaded GPU -> CPU tier -> files. Engine B, a
fresh process with an empty CPU tier and the same ``root_dir``, serves the same prompt: its prefix must be promoted from
the files into its CPU tier and loaded by our kernel (192 cached tokens: 6 GPU blocks of 32, the last prompt token is
always recomputed), with A's greedy tokens (a wrong byte changes them: tests/e2e/vllm_e2e_driver.py's tiny Llama; the
ours-f2 case runs the real model, SmolLM2-135M-Instruct, on real text, and compares A's and B's text). A and B run
``TritonTieringOffloadingSpec``, or A runs vLLM's own tiering spec with a test-only worker that writes vLLM's native
layout through its region views (vLLM's real worker needs CUDA). Each engine's shared region file must be gone once it
exits. Both run with umask 022 and a ``root_dir`` that does not exist yet, under a world-readable directory: our spec
creates it 0700, so no KV file is readable by other users (vLLM's own spec, as A of the native case, leaves them 0644 in
0755 directories, and B then warns). One process per engine: tests/e2e/vllm_tiering_driver.py.
"""

from __future__ import annotations

import json
import pathlib
import re
import stat

import pytest
import vllm_harness
from permissions import exposed_below
from vllm_harness import assert_shm_released, region_files, require_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine("vllm.v1.kv_offload.tiering.spec")]


def run_engine(
    model: pathlib.Path, root: pathlib.Path, block_size: int, *args: str, check: bool = True, env: dict | None = None
) -> dict:
    return vllm_harness.run_tiering(
        model, "--root", str(root), "--block-size", str(block_size), "--umask", "022", *args, check=check, env=env
    )


def a_then_b(
    model: pathlib.Path, root: pathlib.Path, block_size: int, writer: str, numa_node: str | int | None = None
) -> tuple[dict, dict]:
    chunks = 192 // block_size
    ours = [] if numa_node is None else ["--extra", json.dumps({"numa_node": numa_node})]
    a = run_engine(
        model, root, block_size, "--spec", writer, "--wait-stored", str(chunks), *(ours * (writer == "ours"))
    )
    assert len(a["stored"][0]) == chunks, f"A's chunks did not all reach the fs tier: {a['stored'][0]}"
    b = run_engine(model, root, block_size, *ours, env=vllm_harness.KEEP_WORKER_TOTALS)  # test_b_... reads its totals
    return a, b


CASES = {  # block size, A's spec, the numa_node of our engines (None: the default, 'auto')
    "ours-f1": (32, "ours", None),  # host block (chunk) = GPU block
    "ours-f2": (64, "ours", 0),  # chunk = 2 GPU blocks; the real model
    "native-f2": (64, "native", "off"),  # A writes vLLM's native layout
}
REAL = {"ours-f2"}  # the cases that run the real model on real text


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """The case's name, A's and B's results and the world-readable directory that holds the (missing) root_dir."""
    block_size, writer, numa_node = CASES[request.param]
    model = request.getfixturevalue("real_model" if request.param in REAL else "tiny_model")
    shared = tmp_path_factory.mktemp(request.param) / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    a, b = a_then_b(model, shared / "kv" / "cache", block_size, writer, numa_node)
    return request.param, a, b, shared


def test_b_loads_the_whole_prefix_from_the_files_with_a_tokens(pair):
    name, a, b, _ = pair
    (a_out,), (b_out,) = a["requests"], b["requests"]
    assert a_out["cached"] == 0, "A runs cold"
    assert b_out["cached"] == 192, f"{name}: B should find all 6 GPU blocks of the prefix in the fs tier"
    assert b_out["tokens"] == a_out["tokens"], f"{name}: greedy tokens differ: the KV loaded back is not A's"
    assert b_out["text"] == a_out["text"] and (bool(a_out["text"]) == (name in REAL)), (a_out, b_out)
    # Promoted from the files (vLLM's tiering metrics), then moved to the GPU by our kernel (our worker's totals).
    assert b["metrics"]["vllm:kv_offload_tiering_chunk_hits{tier=1:fs}"] == 192 // a["block_size"]
    assert b["metrics"]["vllm:prompt_tokens_cached_by_source{source=disk}"] == 192
    assert "'load_jobs': 1" in b["log"] and f"'loaded_bytes': {6 * b['block_bytes']}" in b["log"]


def test_worker_says_where_its_slots_are(pair):
    """B's worker (ours in every case) names its numa_node choice and its pages read back from numa_maps: bound to
    node 0 under ours-f2, 'off' under native-f2, 'auto' without a GPU (not bound) under ours-f1."""
    name, _, b, _ = pair
    why = {
        "ours-f1": "numa_node = 'auto' without a GPU (cpu): not bound",
        "ours-f2": "numa_node = 0",
        "native-f2": "numa_node = 'off': not bound (the kernel's default policy)",
    }[name]
    (line,) = re.findall(r"triton-offload tiering worker: shared region .*", b["log"])
    assert f"; {why}; this worker's pages: node " in line, line
    if name == "ours-f2":
        assert "this worker's pages: node 0: " in line and re.search(
            r"this worker's pages: node 0: [^;]*; policy", line
        )


def test_no_region_file_is_left_after_the_engines_exit(pair):
    name, a, b, _ = pair
    ours = {"A": a, "B": b} if name.startswith("ours") else {"B": b}
    for engine, result in ours.items():
        assert_shm_released(result, f"{name}: {engine}")


def test_no_kv_file_is_readable_by_other_users(pair):
    """Real KV files under a root_dir our spec created (umask 022, a world-readable parent): none is readable by the
    group or others. With vLLM's own spec as A, they are (0644 files in 0755 directories), which this check sees,
    and B names the shared root_dir at startup."""
    name, a, b, shared = pair
    blocks = [p for p in shared.rglob("*.bin") if p.is_file()]
    assert len(blocks) >= len(a["stored"][0]) > 0, "no KV file was written: the check would pass vacuously"
    exposed = exposed_below(shared)
    root = "kv_connector_extra_config['secondary_tiers'][0]['root_dir']"
    if name.startswith("ours"):
        assert not exposed, f"{name}: readable by other users: {exposed}"
        assert [stat.S_IMODE(p.stat().st_mode) for p in (shared / "kv", shared / "kv" / "cache")] == [0o700, 0o700]
        assert f"{root} = " not in b["log"], "a root_dir our spec created is private: nothing to warn of"
    else:
        assert any(e.endswith(".bin") for e in exposed), f"vLLM's spec wrote private files after all: {exposed}"
        assert f"{root} = '{shared / 'kv' / 'cache'}' has mode 0755" in b["log"]


def test_missing_root_dir_stops_the_engine_at_startup_naming_the_key(tiny_model, tmp_path):
    bad = json.dumps({"secondary_tiers": [{"type": "fs"}]})
    out = run_engine(tiny_model, tmp_path, 32, "--extra", bad, check=False)
    assert out["returncode"] != 0
    assert "kv_connector_extra_config['secondary_tiers'][0] (type 'fs') needs 'root_dir'" in out["log"]
    assert not region_files(out["log"]), "nothing may be allocated for a refused config"
