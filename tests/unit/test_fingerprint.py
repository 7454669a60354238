"""The configuration fingerprint (connector/fingerprint.py, issue 62): it changes with every field that changes what KV
bytes mean and with nothing else, is the same in every process, names the first field that differs, and reaches the
tiers' namespace, the integrity identities and the p2p handshake. vLLM's config is stood in for by its attributes the
fingerprint reads, over a real transformers config and vLLM's real KV-cache specs (one test checks the stand-in
against a real ``VllmConfig``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="needs vLLM >= 0.32 with its tiering package")

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm_configs import key, offloading_config  # noqa: E402

import triton_offload.connector as plugin  # noqa: E402
from triton_offload import integrity  # noqa: E402
from triton_offload.connector import fingerprint as fpm  # noqa: E402
from triton_offload.connector import tiering  # noqa: E402
from triton_offload.connector.fingerprint import (  # noqa: E402
    INFO_KEY,
    ConfigFingerprint,
    fingerprint_fields,
    weights_identity,
)
from triton_offload.connector.geometry import KVGeometry  # noqa: E402
from triton_offload.connector.p2p_tier import FINGERPRINT_SEPARATOR, P2PTier, check_peer_fingerprint  # noqa: E402
from triton_offload.connector.tiering_config import TritonTieringConfig  # noqa: E402

pytestmark = pytest.mark.vllm
plugin.register()

HF = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
          head_dim=64, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    """A model directory: config.json and one safetensors file (a header and 1 MiB of data)."""
    path = tmp_path_factory.mktemp("fp") / "model"
    path.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 18], "data_offsets": [0, 1 << 20]}}).encode()
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    (path / "config.json").write_text("{}")
    return path


def vllm_config(model: str | pathlib.Path, hf: dict | None = None, **changes):
    """What the fingerprint reads of a ``VllmConfig``; ``changes``: ``"model.dtype"``-style attribute paths."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**{**HF, **(hf or {})})
    model_config = SimpleNamespace(
        model=str(model), revision=None, dtype=torch.float32, quantization=None, use_mla=False, max_model_len=512,
        hf_config=hf_config, hf_text_config=hf_config,
        get_total_num_attention_heads=lambda: hf_config.num_attention_heads,
        get_total_num_kv_heads=lambda: hf_config.num_key_value_heads,
        get_head_size=lambda: hf_config.head_dim,
        get_sliding_window=lambda: getattr(hf_config, "sliding_window", None),
    )  # fmt: skip
    cache = SimpleNamespace(
        cache_dtype="auto", sliding_window=None, calculate_kv_scales=False, block_size=16,
        kv_cache_dtype_skip_layers=[], gpu_memory_utilization=0.9, enable_prefix_caching=True,
    )  # fmt: skip
    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    root = SimpleNamespace(
        model_config=model_config, cache_config=cache, parallel_config=parallel, seed=0,
        scheduler_config=SimpleNamespace(max_num_seqs=4), kv_cache=SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            kv_cache_spec=spec)]), offloading=SimpleNamespace(kv_cache_layout="NHD", replicated_layout=False),
    )  # fmt: skip
    for path, value in changes.items():
        obj, *names = path.split(".")
        target = getattr(root, {"model": "model_config", "cache": "cache_config", "parallel": "parallel_config",
                                "spec": "kv_cache"}.get(obj, obj))  # fmt: skip
        if obj == "spec":
            target.kv_cache_groups[0].kv_cache_spec = spec = dataclasses.replace(spec, **{names[0]: value})
        else:
            setattr(target, names[0], value)
    return root


def fp_of(root, label=None) -> ConfigFingerprint:
    return ConfigFingerprint.of(fingerprint_fields(root, root.kv_cache, root.offloading), label)


def first_difference(a: ConfigFingerprint, b: ConfigFingerprint) -> str | None:
    why = a.difference(b.wire())
    return None if why is None else re.match(r"configuration field '([^']+)' differs", why).group(1)


# (id, hf changes, attribute changes, the field named first)
CHANGES = [
    ("rope_theta", {"rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}, {},
     "rope.rope_parameters.rope_theta"),
    ("rope_scaling", {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}}, {},
     "rope.rope_parameters.factor"),
    ("partial_rotary", {"partial_rotary_factor": 0.5}, {}, "rope.partial_rotary_factor"),
    ("num_heads", {"num_attention_heads": 4}, {}, "num_attention_heads"),
    ("num_kv_heads", {"num_key_value_heads": 1}, {}, "num_kv_heads"),
    ("head_dim", {"head_dim": 32}, {}, "head_dim"),
    ("sliding_window", {"sliding_window": 64}, {}, "sliding_window.model"),
    ("attention_variant", {"layer_types": ["sliding_attention", "full_attention"]}, {}, "attention.layer_types"),
    ("mla_dims", {"kv_lora_rank": 512}, {}, "mla.kv_lora_rank"),
    ("use_mla", {}, {"model.use_mla": True}, "attention.use_mla"),
    ("quantization", {}, {"model.quantization": "fp8"}, "quantization.method"),
    ("dtype", {}, {"model.dtype": torch.bfloat16}, "dtype"),
    ("kv_cache_dtype", {}, {"cache.cache_dtype": "fp8_e4m3"}, "kv_cache_dtype.cache_dtype"),
    ("kv_scales", {}, {"cache.calculate_kv_scales": True}, "kv_cache_dtype.calculate_kv_scales"),
    ("kv_spec_dtype", {}, {"spec.dtype": torch.bfloat16}, "kv_cache_dtype.resolved"),
    ("block_size", {}, {"spec.block_size": 32}, "block_size"),
    ("layout", {}, {"offloading.kv_cache_layout": "HND"}, "layout"),
    ("tp_size", {}, {"parallel.tensor_parallel_size": 2}, "parallel.tp"),
    ("pp_size", {}, {"parallel.pipeline_parallel_size": 2}, "parallel.pp"),
    ("architecture", {"architectures": ["MistralForCausalLM"]}, {}, "architecture.architectures"),
    ("other_config_key", {"rms_norm_eps": 1e-5}, {}, "config"),
    ("model_name", {}, {"model.model": "/elsewhere/model"}, "model"),
]  # fmt: skip


@pytest.mark.parametrize("hf,attrs,field", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_each_field_changes_the_fingerprint_and_is_named(model_dir, hf, attrs, field):
    base, changed = fp_of(vllm_config(model_dir)), fp_of(vllm_config(model_dir, hf, **attrs))
    assert base.digest != changed.digest and base.namespace != changed.namespace and base.person != changed.person
    assert first_difference(changed, base) == field


def test_the_weights_identity_is_their_bytes_not_their_path_or_times(model_dir, tmp_path):
    """Weight files are read (names, sizes, the safetensors header, 64 KiB from each end of the data): a copy
    elsewhere, with other modification times, is the same weights; a changed byte at either end is not. A hub model
    is its revision (vLLM resolves it to a commit)."""
    copy_dir = tmp_path / "copy"
    shutil.copytree(model_dir, copy_dir)
    os.utime(copy_dir / "model.safetensors", (1, 1))
    assert weights_identity(str(copy_dir)) == weights_identity(str(model_dir))
    blob = bytearray((copy_dir / "model.safetensors").read_bytes())
    for at in (-1, len(blob) - (1 << 20)):
        changed = blob.copy()
        changed[at] ^= 1
        (copy_dir / "model.safetensors").write_bytes(changed)
        assert weights_identity(str(copy_dir)) != weights_identity(str(model_dir)), at
    assert weights_identity("org/model", "abc") != weights_identity("org/model", "abd")
    assert fp_of(vllm_config(copy_dir)).wire() != fp_of(vllm_config(model_dir)).wire()


UNRELATED = {
    "token_ids": {"eos_token_id": 7, "bos_token_id": 3, "pad_token_id": 5},
    "sampling_defaults": {"temperature": 0.3, "top_p": 0.5, "top_k": 4, "do_sample": True, "repetition_penalty": 1.2},
    "runtime_flags": {"use_cache": False, "output_attentions": True, "transformers_version": "0.0.1"},
    "training_only": {"initializer_range": 0.5, "attention_dropout": 0.1},
}


@pytest.mark.parametrize("hf", list(UNRELATED.values()), ids=list(UNRELATED))
def test_settings_that_do_not_change_kv_do_not_change_it(model_dir, hf):
    """config.json's token ids, generation (sampling) defaults, runtime flags and training-only keys, and the engine's
    serving settings (memory, batch size, seed, max_model_len, prefix caching)."""
    base = fp_of(vllm_config(model_dir))
    assert fp_of(vllm_config(model_dir, hf)).digest == base.digest
    serving = {"cache.gpu_memory_utilization": 0.5, "model.max_model_len": 128, "seed": 7}
    root = vllm_config(model_dir, **{k: v for k, v in serving.items() if "." in k})
    root.seed, root.scheduler_config.max_num_seqs, root.cache_config.enable_prefix_caching = 7, 64, False
    assert fp_of(root).digest == base.digest


def test_nothing_of_the_process_is_in_it(model_dir):
    """No address (an object without a ``__str__`` of its own), no set order (hash seeds differ between processes), no
    dict order, no time: two builds of the same configuration give the same digest. (Across processes and runs:
    tests/e2e/test_vllm_tiering_e2e.py compares the digests the engines' scheduler and worker processes log.)"""

    class Opaque:
        pass

    a = ConfigFingerprint.of({"o": Opaque(), "s": {"b", "a", "c"}, "d": {"y": 1, "x": 2}})
    b = ConfigFingerprint.of({"o": Opaque(), "s": {"c", "a", "b"}, "d": {"x": 2, "y": 1}})
    assert a == b and "0x" not in a.describe()
    assert fp_of(vllm_config(model_dir)).digest == fp_of(vllm_config(model_dir)).digest


def test_the_stand_in_reads_as_a_real_vllm_config(model_dir, tmp_path):
    """vLLM's own ``VllmConfig`` of the same model gives the same config.json-derived fields as the stand-in above:
    the attributes read exist under these names in this vLLM."""
    from transformers import LlamaConfig
    from vllm.engine.arg_utils import EngineArgs

    real_dir = tmp_path / "real"
    shutil.copytree(model_dir, real_dir)
    LlamaConfig(**HF, architectures=["LlamaForCausalLM"]).save_pretrained(real_dir)
    try:
        real = EngineArgs(model=str(real_dir), skip_tokenizer_init=True, dtype="float32").create_engine_config()
    except RuntimeError as e:  # vLLM 0.33's CUDA wheel over a CPU torch: no platform to build a config for
        pytest.skip(f"this vLLM cannot build an engine config here: {e}")
    got = fingerprint_fields(real)
    stand_in = fingerprint_fields(vllm_config(real_dir, {"architectures": ["LlamaForCausalLM"]}))
    for name in ("weights", "rope", "num_attention_heads", "num_kv_heads", "head_dim", "mla", "quantization", "dtype"):
        assert got[name] == stand_in[name], name
    assert got["attention"]["use_mla"] is False and got["sliding_window"] == {"model": None, "cache": None}


def spec_with(monkeypatch, fields, extra=None, name="tiny"):
    """Our tiering spec as vLLM builds it, whose process read ``fields`` from vLLM's config."""
    monkeypatch.setattr(tiering, "geometry_for", lambda config: KVGeometry((), fingerprint=fields))
    config = offloading_config({"spec_name": plugin.TIERING_SPEC_NAME, "cpu_bytes_to_use": 1 << 20, **(extra or {})},
                               groups=((0,),), worker_bytes=4096, f=1)  # fmt: skip
    return OffloadingSpecFactory.create_spec(config)


def test_the_tiers_namespace_carries_it_and_the_override_is_warned_of(model_dir, monkeypatch, caplog):
    """fs file names (and obj keys, the p2p handshake: the same FileMapper fields) differ between configurations; a
    label shares one namespace across configurations, 'off' gives vLLM's own, each warned of."""
    a, b = (fingerprint_fields(vllm_config(model_dir, hf)) for hf in ({}, CHANGES[0][1]))
    with caplog.at_level(logging.INFO, logger="triton_offload"):
        spec_a, spec_b = spec_with(monkeypatch, a), spec_with(monkeypatch, b)
    assert spec_a.config.model.name == "tiny" + spec_a.fingerprint.namespace
    paths = {FileMapper.from_offloading_spec("/r", s).get_file_name(key(1)) for s in (spec_a, spec_b)}
    assert len(paths) == 2
    assert f"triton-offload configuration fingerprint {spec_a.fingerprint.digest}: model=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="triton_offload"):
        shared = [spec_with(monkeypatch, f, {"config_fingerprint": "team-llama"}) for f in (a, b)]
        off = spec_with(monkeypatch, a, {"config_fingerprint": "off"})
    assert shared[0].config.model.name == shared[1].config.model.name != spec_a.config.model.name
    assert off.fingerprint is None and off.config.model.name == "tiny"
    assert "config_fingerprint = 'team-llama': every instance with this label shares" in caplog.text
    assert "config_fingerprint = 'off': the tiers' namespace is vLLM's alone" in caplog.text


def test_the_host_format_and_its_version_are_fields(monkeypatch):
    """The host_format field names the format of our bytes and its version (triton_offload/host_format.py): another
    format, or the same one's next version, is another namespace."""
    config = offloading_config({}, groups=((0,),), worker_bytes=1024, f=1)
    spec = spec_with(monkeypatch, None)
    assert json.loads(dict(spec.fingerprint.fields)["host_format"])["format"] == "native"
    fields = {"model": "m"}
    native = fpm.spec_fingerprint(config, fields, "auto", host_format="native", host_layout="packed")
    assert json.loads(dict(native.fields)["host_format"]) == {
        "version": fpm.FINGERPRINT_VERSION, "format": "native", "format_version": 1, "host_layout": "packed"
    }  # fmt: skip
    fp8 = fpm.spec_fingerprint(config, fields, "auto", host_format="fp8_e4m3", host_layout="packed")
    monkeypatch.setitem(fpm.FORMAT_VERSIONS, "native", 2)
    bumped = fpm.spec_fingerprint(config, fields, "auto", host_format="native", host_layout="packed")
    assert len({native.digest, fp8.digest, bumped.digest}) == 3
    with pytest.raises(ValueError, match="unknown host_format 'fp4'"):
        fpm.spec_fingerprint(config, fields, "auto", host_format="fp4")


def test_without_vllms_config_it_falls_back_to_the_offloading_config_and_says_so(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="triton_offload"):
        spec = spec_with(monkeypatch, None)
    assert spec.config.model.name == "tiny" + spec.fingerprint.namespace
    assert "read from vLLM's offloading config only" in caplog.text


@pytest.mark.parametrize("value", ["", "two words", "x" * 65, 3, None], ids=["empty", "space", "long", "int", "none"])
def test_a_bad_override_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=re.escape(f"config_fingerprint = {value!r}: expected 'auto'")):
        TritonTieringConfig.from_extra_config({"cpu_bytes_to_use": 1 << 20, "config_fingerprint": value})


def test_block_identities_mix_it_in():
    """BLAKE2b's person parameter: without one, the identities are unchanged (version 2's); with one, every
    identity differs, and the same person gives the same identities."""
    import hashlib

    keys = [key(i) for i in range(64)]
    plain = integrity.identities_of_keys(keys)
    expected = [int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little", signed=True) for k in keys]
    assert plain.tolist() == expected
    a, b = ConfigFingerprint.of({"x": 1}).person, ConfigFingerprint.of({"x": 2}).person
    mixed = integrity.identities_of_keys(keys, a)
    assert (mixed != plain).all() and (mixed != integrity.identities_of_keys(keys, b)).all()
    assert np.array_equal(mixed, integrity.identities_of_keys(keys, a))
    assert integrity.key_identity(keys[3], a) == mixed[3]
    with pytest.raises(ValueError, match="person is 17 bytes; BLAKE2b takes at most 16"):
        integrity.identities_of_keys(keys, b"x" * 17)


class Session:
    """What the check reads of vLLM's ``P2PSession``."""

    def __init__(self, block_len=4096):
        self.peer_id, self._local_block_len, self.dead, self.connects = "10.0.0.6:5710", block_len, False, []
        self._conn = SimpleNamespace(mark_dead=lambda: setattr(self, "dead", True))

    def _on_connect(self, msg):
        self.connects.append(msg)


def connect(fp: ConfigFingerprint | None, block_len=4096) -> dict:
    wire = "0123456789abcdef" + ("" if fp is None else FINGERPRINT_SEPARATOR + fp.wire())
    return {"config_fingerprint": wire, "block_len": block_len}


def test_a_peer_of_another_configuration_is_refused_naming_the_field(model_dir, caplog):
    """P2PTier's sessions check a peer's connect message ahead of vLLM: another fingerprint is refused (logged as
    vLLM logs its refusals, the connection marked dead) naming the field; a peer of another chunk length, or one
    without our fields, is left to vLLM's own checks (which compare the chunk length and the whole string)."""
    ours, theirs = fp_of(vllm_config(model_dir)), fp_of(vllm_config(model_dir, CHANGES[0][1]))
    tier = P2PTier.__new__(P2PTier)
    tier._fingerprint = ours
    session = tier._checked(Session())
    assert tier._checked(session) is session
    with caplog.at_level(logging.ERROR, logger="triton_offload"):
        session._on_connect(connect(theirs))
    assert session.dead and not session.connects
    assert (
        "P2PSession 10.0.0.6:5710: rejecting peer connect: configuration fingerprint mismatch: configuration field "
        "'rope.rope_parameters.rope_theta' differs: remote=20000.0, local=10000.0" in caplog.text
    )
    for msg in (connect(ours), connect(theirs, block_len=8192), connect(None)):
        fresh = tier._checked(Session())
        fresh._on_connect(msg)
        assert fresh.connects == [msg] and not fresh.dead
    labelled = ConfigFingerprint.of({}, "team-llama")
    assert "config_fingerprint differs: remote='team-llama', local='computed'" in ours.difference(labelled.wire())
    assert check_peer_fingerprint(Session(), labelled, connect(ConfigFingerprint.of({"x": 1}, "team-llama")))


def test_the_wire_is_short_and_parses_back(model_dir):
    """Long values (the KV-cache specs) travel as digests; a peer's wire that is not ours is named, not raised."""
    fp = fp_of(vllm_config(model_dir))
    assert len(fp.wire()) < 2000 and '"kv_cache_spec":"digest:' in fp.wire()
    assert fp.difference(fp.wire()) is None
    assert "is not ours' kind" in fp.difference("garbage")
    assert fpm.fingerprint_setting("auto") == "auto" and fpm.fingerprint_setting("a.b-c_1") == "a.b-c_1"


def test_vllms_config_info_metric_carries_the_digest_as_a_label(model_dir, monkeypatch):
    """vLLM >= 0.33 publishes its CPU tier's static facts as labels of ``vllm:kv_offload_config_info``: the tiering
    spec declares one more, the fingerprint's digest (``off`` where it is off), and its manager fills it."""
    if not hasattr(tiering.TieringOffloadingSpec, "config_info_keys"):
        pytest.skip("vLLM < 0.33 publishes no config info metric")
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo

    fields = fingerprint_fields(vllm_config(model_dir, {}))
    for extra, want in (({}, None), ({"config_fingerprint": "off"}, "off")):
        spec = spec_with(monkeypatch, fields, extra)
        keys = type(spec).config_info_keys(spec.extra_config)
        assert keys[-1] == INFO_KEY and set(CPUOffloadingInfo.config_info_keys()) < set(keys)
        labels = spec.cpu_info.as_config_info()
        assert labels[INFO_KEY] == (want or spec.fingerprint.digest)
        assert labels["cpu_num_chunks"] == spec.num_chunks
