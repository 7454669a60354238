"""The plugin's configuration checked in the front-end process, before vLLM loads the model (connector/preflight.py),
through vLLM's own ``EngineArgs.create_engine_config`` on a tiny local model: no engine is started, nothing is
downloaded. Also the ``fs`` tier's ``root_dir`` writability and the memory messages."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM >= 0.32 (pip install 'triton-offload[vllm]')")

import triton_offload.connector as plugin  # noqa: E402
from triton_offload.connector import compat, preflight  # noqa: E402
from triton_offload.connector.preflight import MemoryFacts, check_block_size, check_memory  # noqa: E402

pytestmark = pytest.mark.vllm
GiB = 2**30
plugin.register()  # as vLLM's plugin loading does in each of its processes


@pytest.fixture(scope="module")
def engine_config(tiny_model):
    """``engine_config(extra, **engine_args)``: vLLM's ``VllmConfig`` for the tiny model with an OffloadingConnector
    of that ``kv_connector_extra_config``, built by ``EngineArgs.create_engine_config`` as ``vllm serve`` and ``LLM``
    build it (so through our check, which vLLM's plugin loading installed)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip("vLLM found no platform to build an engine config for (its Python API alone, e.g. .venv-vllm33)")

    def build(extra: dict, **kwargs):
        args = dict(model=str(tiny_model), skip_tokenizer_init=True, dtype="float32", enable_prefix_caching=True)
        ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
        return EngineArgs(**{**args, **kwargs}, kv_transfer_config=ktc).create_engine_config()

    return build


PACKED = {"spec_name": "TritonOffloadingSpec", "cpu_bytes_to_use": "16MiB"}
TIERING = {"spec_name": "TritonTieringOffloadingSpec", "cpu_bytes_to_use": "16MiB"}


def test_vllms_plugin_loading_installs_the_check_once(engine_config):
    from vllm.engine.arg_utils import EngineArgs

    engine_config(PACKED, kv_cache_memory_bytes=32 << 20)  # EngineArgs.__post_init__ loads the general plugins
    wrapped = EngineArgs.create_engine_config
    assert getattr(wrapped, "_triton_offload_preflight", False), "register() did not install the check"
    plugin.register()
    assert preflight.install() and EngineArgs.create_engine_config is wrapped, "installed twice"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        pytest.param(
            {**PACKED, "eviction_polcy": "arc"}, "'eviction_polcy' (did you mean 'eviction_policy'?)", id="misspelt-key"
        ),
        pytest.param(
            {"spec_name": "TritonOffloadingSpec", "cpu_byte_to_use": "16MiB"},
            "'cpu_byte_to_use' (did you mean 'cpu_bytes_to_use'?)",
            id="misspelt-required",
        ),
        pytest.param(
            {**PACKED, "spec_name": "TritonOffloadSpec"},
            "kv_connector_extra_config['spec_name'] = 'TritonOffloadSpec' is not an offloading spec vLLM knows (did "
            "you mean 'TritonOffloadingSpec'?); registered: CPUOffloadingSpec, TieringOffloadingSpec, "
            "TritonOffloadingSpec, TritonTieringOffloadingSpec",
            id="spec-name",
        ),
        pytest.param(
            {**PACKED, "block_size": 64},
            "kv_connector_extra_config['block_size'] = 64 tokens must be a multiple of vLLM's KV-cache block size, "
            "128 tokens here: use 128, 256, 384",
            id="block-size-cpu-default",
        ),
        pytest.param({**PACKED, "eviction_policy": "fifo"}, "accepted: arc, lru", id="bad-value"),
        pytest.param(
            {**TIERING, "secondary_tiers": [{"type": "fs", "rootdir": "/tmp/kv"}]},
            "needs 'root_dir': the directory shared by every instance that reads these blocks (found 'rootdir': a "
            "misspelling of 'root_dir'?)",
            id="tiering-tier-key",
        ),
        pytest.param(
            {**TIERING, "secondary_tier": []}, "'secondary_tier' (did you mean 'secondary_tiers'?)", id="tiering-key"
        ),
        pytest.param(
            {**PACKED, "cpu_bytes_to_use": "64TiB"},
            "cpu_bytes_to_use = 70368744177664 bytes (65536.00 GiB) for the host cache does not fit in this machine's "
            "host memory beside the 0.03 GiB vLLM's CPU build allocates for its own KV cache (--kv-cache-memory-bytes",
            id="budget",
        ),
    ],
)
def test_each_mistake_is_refused_when_vllm_builds_its_config(engine_config, extra, match):
    """vLLM builds its config in the front-end process before any engine process starts (so before the model
    loads); a mistake there used to surface 52-90 s later, after the model load, in a ~260-line traceback."""
    with pytest.raises(ValueError, match=re.escape(match)):
        engine_config(extra, kv_cache_memory_bytes=32 << 20)


def test_the_block_size_is_checked_against_vllms_own(engine_config):
    assert engine_config({**PACKED, "block_size": 64}, block_size=32, kv_cache_memory_bytes=32 << 20)
    with pytest.raises(ValueError, match="must be a multiple of vLLM's KV-cache block size, 64 tokens here"):
        engine_config({**PACKED, "block_size": 96}, block_size=64, kv_cache_memory_bytes=32 << 20)


def test_other_specs_are_left_to_their_owners(engine_config):
    assert engine_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": 2}, kv_cache_memory_bytes=32 << 20)
    assert engine_config(
        {"spec_name": "CPUOffloadingSpec", "spec_module_path": "vllm.v1.kv_offload.cpu.spec", "colour": "red"},
        kv_cache_memory_bytes=32 << 20,
    ), "a spec named with its module path that is not ours: its own to check"


def test_a_spec_module_that_does_not_import_is_refused(engine_config):
    with pytest.raises(ValueError, match=re.escape("['spec_module_path'] = 'some.where' does not give spec_name")):
        engine_config({**PACKED, "spec_name": "MySpec", "spec_module_path": "some.where"})


def _multi(extra):
    from types import SimpleNamespace

    child = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
    return _Config(SimpleNamespace(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [child]}))


def test_a_multiconnector_child_is_checked(monkeypatch):
    monkeypatch.setattr("vllm.__version__", "0.33.0")  # past the version check below
    with pytest.raises(ValueError, match=re.escape("'num_cta' (did you mean 'num_ctas'?)")):
        preflight.check_vllm_config(_multi({**PACKED, "num_cta": 4}))


@pytest.mark.parametrize("version, refused", [("0.32.0", True), ("0.32.1+cpu", True), ("0.33.0", False)])
def test_multiconnector_needs_vllm_033(monkeypatch, version, refused):
    """vLLM 0.32 under MultiConnector can store a block another connector is writing (its scheduler skips recording
    an allocation without an offload hit, vLLM #46951): refused before the model loads, naming the version and the
    fix. OffloadingConnector alone is accepted on 0.32."""
    monkeypatch.setattr("vllm.__version__", version)
    if refused:
        with pytest.raises(ValueError, match=rf"needs vLLM >= 0.33; this is vLLM {re.escape(version)}.*#46951"):
            preflight.check_vllm_config(_multi(PACKED))
    else:
        preflight.check_vllm_config(_multi(PACKED))
    compat.check_multi_connector("OffloadingConnector", "0.32.0")
    compat.check_multi_connector("MultiConnector", "0.33.1rc1.dev5+gabcdef")


class _Config:
    """The parts of a VllmConfig the check reads, for a case EngineArgs cannot build here (MultiConnector)."""

    def __init__(self, ktc):
        from types import SimpleNamespace

        self.kv_transfer_config = ktc
        self.cache_config = SimpleNamespace(block_size=128, kv_cache_memory_bytes=32 << 20, gpu_memory_utilization=0.9)
        self.model_config = SimpleNamespace(is_hybrid=False)
        self.parallel_config = SimpleNamespace(decode_context_parallel_size=1, nnodes=1, data_parallel_size=1)


# -- the pieces ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "gpu_block", "f"),
    [
        ({}, 32, 1),
        ({}, None, None),
        ({"block_size": 64}, 32, 2),
        ({"block_size": "64"}, 32, 2),
        ({"block_size": 64}, None, None),
        ({"blocks_per_chunk": 3}, None, 3),
    ],
)
def test_the_factor_vllm_will_derive(extra, gpu_block, f):
    assert check_block_size(extra, gpu_block) == f


def test_block_size_and_blocks_per_chunk_together_are_refused():
    with pytest.raises(ValueError, match="both 'block_size' and 'blocks_per_chunk'"):
        check_block_size({"block_size": 64, "blocks_per_chunk": 2}, 32)


def test_memory_beside_an_explicit_cpu_kv_cache():
    facts = MemoryFacts(total=16 * GiB, available=8 * GiB, cpu_kv_bytes=4 * GiB)
    check_memory(4 * GiB, "the host cache", facts)
    with pytest.raises(ValueError) as info:
        check_memory(4 * GiB + 1, "the host cache", facts)
    text = str(info.value)
    assert "beside the 4.00 GiB vLLM's CPU build allocates for its own KV cache (--kv-cache-memory-bytes" in text
    assert "8.00 GiB are available (MemAvailable" in text


def test_memory_beside_vllms_cpu_default_names_the_flag_that_sizes_it():
    """vLLM's CPU build takes --gpu-memory-utilization (0.92 by default) of MemTotal for itself unless its KV cache
    is sized: then no budget fits, and the message says which flag to set."""
    facts = MemoryFacts(total=16 * GiB, available=15 * GiB, cpu_utilization=0.92)
    with pytest.raises(ValueError) as info:
        check_memory(1 * GiB, "the host cache", facts)
    text = str(info.value)
    assert "vLLM's CPU build reserves for itself (--gpu-memory-utilization = 0.92 of 16.00 GiB MemTotal" in text
    assert "Size vLLM's own KV cache with --kv-cache-memory-bytes (e.g. --kv-cache-memory-bytes 1G" in text


def test_memory_on_a_gpu_counts_the_budget_only():
    facts = MemoryFacts(total=16 * GiB, available=8 * GiB)
    check_memory(8 * GiB, "the host cache", facts)
    with pytest.raises(ValueError, match="Lower cpu_bytes_to_use, or free host memory"):
        check_memory(8 * GiB + 1, "the host cache", facts)
    check_memory(1 << 50, "the host cache", MemoryFacts(None, None))  # MemAvailable unreadable: not checked


# -- the fs tier's root_dir ------------------------------------------------------------------------------------------


def _as_nobody(imports: str, body: str) -> subprocess.CompletedProcess:
    """Runs ``imports``, then drops the effective ids to nobody (65534), as the service user vLLM runs as would be,
    then runs ``body``, in a fresh interpreter (needs root to switch).

    ``body`` runs once as root first, its output discarded, so that every module it imports lazily (vLLM's eviction
    policy, its tier classes) is loaded as a service user would load them from an installation it can read: this
    checkout may sit below a directory nobody cannot search (mktemp's 0700)."""
    body = textwrap.dedent(body)
    warm = "import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n" + textwrap.indent(body, "    ")
    script = textwrap.dedent(imports) + warm + "import os\nos.setegid(65534)\nos.seteuid(65534)\n" + body
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")


@pytest.fixture
def open_dir():
    """A root-owned directory every user can search (pytest's own tmp_path is 0700 on the way), removed after."""
    import shutil
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp(prefix="preflight-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@needs_root
@pytest.mark.parametrize("missing", [False, True], ids=["existing", "to-create"])
def test_a_root_dir_this_user_cannot_write_is_refused_naming_the_permission(open_dir, missing):
    """The issue's case: an existing root_dir owned by someone else, 0755. It used to end in a bare PermissionError
    after the model load, with a warning that "others may reach the KV files" (they may read, but the real problem
    was that vLLM could not write)."""
    top = open_dir / "kv"
    top.mkdir(mode=0o755)
    root = top / "below" if missing else top
    out = _as_nobody(
        "from triton_offload.connector.fs_root import check_root_dir\n",
        f"""
        try:
            check_root_dir({str(root)!r}, "root_dir")
        except ValueError as e:
            print("REFUSED", e)
        """,
    )
    assert out.returncode == 0, out.stderr
    job = "create it below it" if missing else "write its block files below it"
    assert (
        f"REFUSED root_dir = {str(root)!r}: {str(top)!r} is not writable and searchable by this process (uid 65534"
        in (out.stdout)
    )
    assert f"owned by uid 0 (root), mode 0755), so the fs tier cannot {job}" in out.stdout


@needs_root
def test_the_tiering_config_refuses_it_before_anything_is_built(open_dir):
    (open_dir / "kv").mkdir(mode=0o755)
    extra = {**TIERING, "secondary_tiers": [{"type": "fs", "root_dir": str(open_dir / "kv")}]}
    out = _as_nobody(
        "import json\nfrom triton_offload.connector.tiering_config import TritonTieringConfig\n",
        f"""
        try:
            TritonTieringConfig.from_extra_config(json.loads({json.dumps(extra)!r}))
        except ValueError as e:
            print("REFUSED", e)
        """,
    )
    assert out.returncode == 0, out.stderr
    assert "REFUSED kv_connector_extra_config['secondary_tiers'][0]['root_dir'] = " in out.stdout
    assert "is not writable and searchable by this process" in out.stdout
    assert "may reach the KV files" not in out.stdout + out.stderr


def test_a_writable_root_dir_passes(tmp_path):
    from triton_offload.connector.fs_root import check_root_dir

    assert check_root_dir(str(tmp_path / "new" / "kv"), "root_dir") == str(tmp_path / "new" / "kv")
    assert check_root_dir(str(tmp_path), "root_dir") == str(tmp_path)
