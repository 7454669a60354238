"""The plugin's configuration parsing and its import without vLLM (plain Python: runs with or without vLLM)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from triton_offload.connector.config import TritonOffloadConfig, parse_size


def parse(extra: dict, f: int = 1, gpu_block_tokens: int | None = 16) -> TritonOffloadConfig:
    return TritonOffloadConfig.from_extra_config(extra, blocks_per_host_block=f, gpu_block_tokens=gpu_block_tokens)


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [
        pytest.param(1 << 30, 1 << 30, id="int"),
        pytest.param(4e10, 40_000_000_000, id="whole-float"),
        pytest.param("1073741824", 1 << 30, id="digit-string"),
        pytest.param("40GiB", 40 << 30, id="GiB"),
        pytest.param("512MiB", 512 << 20, id="MiB"),
        pytest.param("1.5GB", 1_500_000_000, id="decimal-GB"),
        pytest.param(" 2 kib ", 2048, id="spaces-lowercase"),
        pytest.param("64KB", 64_000, id="KB"),
        pytest.param("3B", 3, id="B"),
        pytest.param("1TiB", 1 << 40, id="TiB"),
        pytest.param(".5MiB", 512 << 10, id="leading-dot"),
    ],
)
def test_parse_size_accepts(value, nbytes):
    assert parse_size(value, "cpu_bytes_to_use") == nbytes


@pytest.mark.parametrize(
    ("value", "match"),
    [
        pytest.param(0, "must be positive", id="zero"),
        pytest.param(-5, "must be positive", id="negative"),
        pytest.param("0GiB", "must be positive", id="zero-unit"),
        pytest.param(True, "is not a size", id="bool"),
        pytest.param(1.5, "not a whole number of bytes", id="fractional-float"),
        pytest.param("1.3B", "not a whole number of bytes", id="fractional-bytes"),
        pytest.param("40GX", "is not a size", id="unknown-unit"),
        pytest.param("40 G", "is not a size", id="ambiguous-unit"),
        pytest.param("GiB", "is not a size", id="no-number"),
        pytest.param("-1GiB", "is not a size", id="negative-string"),
        pytest.param("", "is not a size", id="empty"),
        pytest.param([1], "is not a size", id="list"),
        pytest.param(None, "is not a size", id="none"),
    ],
)
def test_parse_size_rejects_with_key_and_accepted_forms(value, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_size(value, "cpu_bytes_to_use")
    assert "cpu_bytes_to_use" in str(info.value)


def test_defaults_and_full_config():
    assert parse({"cpu_bytes_to_use": "1GiB"}) == TritonOffloadConfig(1 << 30, 1, "lru", None)
    cfg = parse({"cpu_bytes_to_use": 4096, "block_size": 64, "eviction_policy": "ARC", "num_ctas": 12}, f=4)
    assert cfg == TritonOffloadConfig(4096, 4, "arc", 12)
    for path in ("auto", "kernel", "dma"):
        assert parse({"cpu_bytes_to_use": 1, "transfer_path": path}).transfer_path == path
    with pytest.raises(AttributeError):
        cfg.num_ctas = 3  # frozen: parsed once, never changed


def test_host_memory_settings_default_and_parse():
    """numa_node, huge_pages and pinning (docs/host-memory.md): defaults, and the forms accepted."""
    cfg = parse({"cpu_bytes_to_use": 1})
    assert (cfg.numa_node, cfg.huge_pages, cfg.pinning) == ("auto", "thp", "auto")
    cfg = parse({"cpu_bytes_to_use": 1, "numa_node": "1", "huge_pages": "2mib", "pinning": " Register"})
    assert (cfg.numa_node, cfg.huge_pages, cfg.pinning) == (1, "2MiB", "register")
    cfg = parse({"cpu_bytes_to_use": 1, "numa_node": 0, "huge_pages": "1GiB"})
    assert (cfg.numa_node, cfg.huge_pages) == (0, "1GiB")
    cfg = parse({"cpu_bytes_to_use": 1, "numa_node": "OFF", "huge_pages": "off", "pinning": "auto"})
    assert cfg == TritonOffloadConfig(1, numa_node="off", huge_pages="off", pinning="auto")
    assert parse({"cpu_bytes_to_use": 1, "pinning": "alloc"}).pinning == "alloc"


def test_integers_written_as_strings_are_read_as_vllm_reads_block_size():
    """JSON on a command line often quotes numbers: vLLM reads its own block_size "64" with int(), and num_ctas "4"
    is read the same way."""
    cfg = parse({"cpu_bytes_to_use": 4096, "block_size": "64", "num_ctas": "4"}, f=4)
    assert cfg == TritonOffloadConfig(4096, 4, "lru", 4)


@pytest.mark.parametrize(
    ("extra", "f", "match"),
    [
        pytest.param({}, 1, "needs 'cpu_bytes_to_use'", id="missing-budget"),
        pytest.param({"cpu_bytes_to_use": None}, 1, "needs 'cpu_bytes_to_use'", id="null-budget"),
        pytest.param({"cpu_bytes_to_use": "lots"}, 1, "cpu_bytes_to_use = 'lots'", id="bad-budget"),
        pytest.param({"cpu_bytes_to_use": 1, "eviction_policy": "fifo"}, 1, "accepted: arc, lru", id="bad-policy"),
        pytest.param({"cpu_bytes_to_use": 1, "eviction_policy": 3}, 1, "eviction_policy = 3", id="policy-type"),
        pytest.param({"cpu_bytes_to_use": 1, "num_ctas": 0}, 1, "num_ctas = 0 must be a positive int", id="ctas-0"),
        pytest.param({"cpu_bytes_to_use": 1, "num_ctas": "8x"}, 1, "num_ctas = '8x' must be", id="ctas-str"),
        pytest.param({"cpu_bytes_to_use": 1, "num_ctas": "0"}, 1, "num_ctas = '0' must be", id="ctas-str-0"),
        pytest.param({"cpu_bytes_to_use": 1, "num_ctas": 4.0}, 1, "num_ctas = 4.0 must be", id="ctas-float"),
        pytest.param({"cpu_bytes_to_use": 1, "num_ctas": True}, 1, "num_ctas = True", id="ctas-bool"),
        pytest.param({"cpu_bytes_to_use": 1, "block_size": 48}, 2, "block_size = 48 tokens", id="block-size-vs-f"),
        pytest.param({"cpu_bytes_to_use": 1, "block_size": "big"}, 1, "block_size = 'big'", id="block-size-type"),
        pytest.param({"cpu_bytes_to_use": 1}, 0, "blocks_per_chunk", id="factor-0"),
        pytest.param(
            {"cpu_bytes_to_use": 1, "transfer_path": "copy"},
            1,
            "transfer_path = 'copy' must be one of 'auto', 'kernel', 'dma'",
            id="bad-path",
        ),
        pytest.param({"cpu_bytes_to_use": 1, "numa_node": "near"}, 1, "numa_node = 'near' is not a NUMA", id="numa"),
        pytest.param({"cpu_bytes_to_use": 1, "numa_node": -1}, 1, "numa_node = -1 is not a NUMA", id="numa-neg"),
        pytest.param({"cpu_bytes_to_use": 1, "numa_node": True}, 1, "numa_node = True is not", id="numa-bool"),
        pytest.param({"cpu_bytes_to_use": 1, "numa_node": 1.0}, 1, "numa_node = 1.0 is not", id="numa-float"),
        pytest.param(
            {"cpu_bytes_to_use": 1, "huge_pages": "4MiB"},
            1,
            "huge_pages = '4MiB' is not a huge-page setting; expected one of 'thp', '2MiB', '1GiB', 'off'",
            id="huge-pages",
        ),
        pytest.param({"cpu_bytes_to_use": 1, "huge_pages": True}, 1, "huge_pages = True is not", id="huge-bool"),
        pytest.param(
            {"cpu_bytes_to_use": 1, "pinning": "pin"},
            1,
            "pinning = 'pin' is not a pinning setting; expected one of 'auto', 'register', 'alloc'",
            id="pinning",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "pinning": "alloc", "huge_pages": "2MiB"},
            1,
            "huge_pages = '2MiB' cannot apply with pinning = 'alloc'",
            id="alloc-with-huge-pages",
        ),
    ],
)
def test_bad_values_name_the_key(extra, f, match):
    with pytest.raises(ValueError, match=match):
        parse(extra, f=f)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        pytest.param(
            {"cpu_bytes_to_use": 1, "eviction_polcy": "arc"},
            "'eviction_polcy' (did you mean 'eviction_policy'?)",
            id="misspelt-optional",
        ),
        pytest.param(
            {"cpu_byte_to_use": "1GiB"}, "'cpu_byte_to_use' (did you mean 'cpu_bytes_to_use'?)", id="misspelt-required"
        ),
        pytest.param(
            {"cpu_bytes_to_use": 1, "store_threshold": 2},
            "'store_threshold' (a key of vLLM's CPUOffloadingSpec)",
            id="cpu-spec-key",
        ),
        pytest.param({"cpu_bytes_to_use": 1, "colour": "red"}, "does not read: 'colour'. It reads: ", id="unknown"),
    ],
)
def test_an_unknown_key_is_an_error_naming_the_key_it_misspells(extra, match):
    """vLLM's own config classes forbid extra fields: a typo here would otherwise run with the default (LRU for a
    misspelt eviction_policy)."""
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        parse(extra)
    assert "kv_connector_extra_config has key(s) TritonOffloadingSpec does not read" in str(info.value)
    assert '"unknown_keys": "warn"' in str(info.value), "the message says how to run with the key ignored"


def test_unknown_keys_warn_is_a_warning_naming_the_key(caplog):
    extra = {"cpu_bytes_to_use": 1, "eviction_polcy": "arc", "spec_name": "x", "unknown_keys": "warn"}
    with caplog.at_level(logging.WARNING, logger="triton_offload.connector.config"):
        cfg = parse({**extra, "offload_prompt_only": False})
    assert cfg.eviction_policy == "lru", "the misspelt key is ignored, as the warning says"
    assert "'eviction_polcy' (did you mean 'eviction_policy'?)" in caplog.text and "ignored" in caplog.text
    assert "(did you mean 'eviction_policy'?). It reads" in caplog.text, "vLLM's own keys (spec_name, ...) are known"


def test_a_missing_required_key_names_its_misspelling_when_unknown_keys_only_warn():
    with pytest.raises(ValueError, match=re.escape("(found 'cpu_byte_to_use': a misspelling of 'cpu_bytes_to_use'?)")):
        parse({"cpu_byte_to_use": "1GiB", "unknown_keys": "warn"})


def test_unknown_keys_accepts_error_or_warn_only():
    with pytest.raises(ValueError, match="unknown_keys = 'ignore' must be one of 'error', 'warn'"):
        parse({"cpu_bytes_to_use": 1, "unknown_keys": "ignore"})


def test_block_size_is_not_checked_without_gpu_block_size():
    assert parse({"cpu_bytes_to_use": 1, "block_size": 48}, f=2, gpu_block_tokens=None).blocks_per_host_block == 2


def test_package_imports_without_vllm():
    """`import triton_offload.connector` must not need vLLM; using the spec then says what is missing."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # makes every `import vllm...` fail, as if not installed
        "import triton_offload, triton_offload.connector as c\n"
        "from triton_offload.connector.config import TritonOffloadConfig\n"
        "try:\n"
        "    c.TritonOffloadingSpec\n"
        "except ImportError as e:\n"
        "    print('IMPORT_ERROR', e)\n"
        "try:\n"
        "    c.register()\n"
        "except ImportError as e:\n"
        "    print('REGISTER_ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORT_ERROR TritonOffloadingSpec needs vLLM >= 0.32" in out.stdout
    assert "REGISTER_ERROR" in out.stdout


def test_host_format_is_read_by_name():
    """host_format: "native" by default, "fp8_e4m3" by name (what it needs from vLLM's specs is checked by the spec:
    tests/unit/test_connector_fp8.py); anything else refused with the formats listed."""
    assert parse(dict(cpu_bytes_to_use=1)).host_format == "native"
    assert parse(dict(cpu_bytes_to_use=1, host_format="fp8_e4m3")).host_format == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"unknown host_format 'bf16'; supported: \['native', 'fp8_e4m3'\]"):
        parse(dict(cpu_bytes_to_use=1, host_format="bf16"))
    with pytest.raises(ValueError, match="host_format = 'fp8_e4m3' does not work with transfer_path"):
        parse(dict(cpu_bytes_to_use=1, host_format="fp8_e4m3", transfer_path="dma"))
    # The FP8 kernel checks what it stores (issue 63): integrity is taken with the format.
    assert parse(dict(cpu_bytes_to_use=1, host_format="fp8_e4m3", integrity="verify")).host_format == "fp8_e4m3"
