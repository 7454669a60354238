"""End to end: an ``obj`` tier (KV chunks as S3 objects through NIXL's OBJ plugin) against a real S3 protocol server
that the test starts on 127.0.0.1 (moto's server mode), every engine with ``TritonTieringOffloadingSpec``.

Engine A (chunk = 2 GPU blocks) serves a 200-token prompt cold with two secondary tiers, the object store and an ``fs``
directory, and exits once both hold its 3 chunks. Engine B, a fresh process with an empty CPU tier and only the object
store, serves the same prompt: all 192 whole-block tokens come back from the objects through our kernel, with A's greedy
tokens and text (both run the real model, SmolLM2-135M-Instruct, on real text). The tier is
:class:`triton_offload.connector.obj_tier.ObjectStoreTier` (vLLM 0.32's obj tier dies at its first finished transfer;
this is it with vLLM 0.33's two changes), so its object names are vLLM 0.33's, which are the ``fs`` tier's file names
under the tier's ``prefix``: the test checks that, and that each object holds exactly the bytes of the file (one chunk
row of the CPU tier). An endpoint nobody listens on stops the engine at startup, naming it. The tier entry is
docs/tiering.md's recipe, read from the page; the S3 server is started as the recipe starts it
(tests/unit/test_readme.py checks the two agree).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import vllm_harness
from doc_recipes import recipe_json
from vllm_harness import (
    GPU_BLOCK,
    assert_shm_released,
    free_port,
    kill_group,
    region_files,
    require_engine,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *require_engine("vllm.v1.kv_offload.tiering.obj.manager")]
pytest.importorskip("nixl._api", reason="the obj tier needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")
pytest.importorskip("moto.server", reason="the test's S3 server: pip install 'moto[s3]' flask flask-cors")
boto3 = pytest.importorskip("boto3")

# docs/tiering.md's recipe: the tier entry a user copies, read from the page (its endpoint replaced by the test's).
RECIPE = recipe_json("obj-tier")
RECIPE_ENDPOINT = "127.0.0.1:9000"
BUCKET, PREFIX = RECIPE["store_config"]["bucket"], RECIPE["prefix"]
CREDENTIALS = {k: RECIPE["store_config"][k] for k in ("access_key", "secret_key", "region")}
BLOCK_SIZE = 2 * GPU_BLOCK  # a chunk (object) of 2 GPU blocks
CHUNKS = 192 // BLOCK_SIZE


def start_s3_server(log: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on 127.0.0.1 at a port the kernel picked (another one if that is taken meanwhile); returns
    it once it accepts connections, with its endpoint."""
    for _ in range(3):
        port = free_port()
        with open(log, "w") as out:
            server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while server.poll() is None and time.monotonic() < deadline:
            try:
                boto3.client("s3", **client_args(f"127.0.0.1:{port}")).list_buckets()
                return server, f"127.0.0.1:{port}"
            except Exception:  # not up yet
                time.sleep(0.2)
        kill_group(server)
        server.wait()
    raise AssertionError(f"moto's S3 server did not start:\n{log.read_text()[-3000:]}")


def client_args(endpoint: str) -> dict:
    return {
        "endpoint_url": f"http://{endpoint}",
        "aws_access_key_id": CREDENTIALS["access_key"],
        "aws_secret_access_key": CREDENTIALS["secret_key"],
        "region_name": CREDENTIALS["region"],
    }


def obj_tier(endpoint: str) -> dict:
    """The recipe's tier entry for the store at ``endpoint``."""
    assert RECIPE["store_config"]["endpoint_override"] == RECIPE_ENDPOINT, "the recipe's endpoint changed"
    return {**RECIPE, "store_config": {**RECIPE["store_config"], "endpoint_override": endpoint}}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The S3 endpoint, with an empty bucket; the server is stopped (its process group killed) at teardown."""
    server, endpoint = start_s3_server(tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        boto3.client("s3", **client_args(endpoint)).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        kill_group(server)
        server.wait()


@pytest.fixture(scope="module")
def pair(real_model, s3, tmp_path_factory):
    root = tmp_path_factory.mktemp("fs")
    fs = {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}
    common = ["--block-size", str(BLOCK_SIZE)]
    a = vllm_harness.run_tiering(
        real_model, *common, "--tiers", json.dumps([obj_tier(s3), fs]), "--wait-stored", str(CHUNKS)
    )
    b = vllm_harness.run_tiering(
        real_model, *common, "--tiers", json.dumps([obj_tier(s3)]), env=vllm_harness.KEEP_WORKER_TOTALS
    )
    return a, b, root


def test_b_loads_the_whole_prefix_from_the_objects_with_a_tokens(pair):
    a, b, _ = pair
    (a_out,), (b_out,) = a["requests"], b["requests"]
    assert a_out["cached"] == 0, "A runs cold"
    assert b_out["cached"] == 192, "B should find all 6 GPU blocks of the prefix in the object store"
    assert b_out["tokens"] == a_out["tokens"], "greedy tokens differ: the KV loaded back is not A's"
    assert a_out["text"] and b_out["text"] == a_out["text"], (a_out, b_out)
    assert b["metrics"]["vllm:kv_offload_tiering_chunk_hits{tier=1:ObjectStoreTier}"] == CHUNKS
    assert b["metrics"]["vllm:prompt_tokens_cached_by_source{source=disk}"] == 192
    assert "'load_jobs': 1," in b["log"] and f"'loaded_bytes': {6 * b['block_bytes']}," in b["log"]


def test_objects_are_named_and_filled_like_the_fs_tier_files(pair, s3):
    """Object ``<prefix>/<model>_<hash of the namespace fields>_r0/<3 hex>/<2 hex>_g<group>/<block hash>.bin`` holds
    one chunk row: what the fs tier writes to the file of the same name under its root_dir."""
    a, _, root = pair
    objects, files = a["stored"]
    assert len(objects) == len(files) == CHUNKS
    assert objects == [f"{PREFIX}/{name}" for name in files]
    client = boto3.client("s3", **client_args(s3))
    for name in files:
        body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}")["Body"].read()
        assert len(body) == 2 * a["block_bytes"], "one row: 2 GPU blocks of the whole model (no padding here)"
        assert body == (root / name).read_bytes(), f"{name}: the object's bytes differ from the fs tier's file"


def test_no_region_file_is_left_after_the_engines_exit(pair):
    a, b, _ = pair
    for name, result in (("A", a), ("B", b)):
        assert_shm_released(result, name)


def test_unreachable_object_store_stops_the_engine_at_startup_naming_it(tiny_model):
    endpoint = f"127.0.0.1:{free_port()}"  # nobody listens there
    t0 = time.monotonic()
    out = vllm_harness.run_tiering(tiny_model, "--tiers", json.dumps([obj_tier(endpoint)]), check=False, timeout=300)
    assert out["returncode"] != 0
    assert (
        f"kv_connector_extra_config['secondary_tiers'][0]: the object store http://{endpoint} is unreachable"
        in (out["log"])
    )
    assert time.monotonic() - t0 < 120, "the refusal must come at startup, not after retries"
    assert not [p for p in region_files(out["log"]) if os.path.exists(p)]
