"""The configuration fingerprint (docs/tiering.md, "Configuration fingerprint"): what makes two engines' KV bytes for
the same tokens the same KV, read once per process from vLLM's configs (:func:`fingerprint_fields`), as named fields
in a fixed order (:class:`ConfigFingerprint`): the model and its weights' identity, the config.json fields that shape
K and V (RoPE, heads, head size, sliding windows, attention variant, MLA dimensions, quantization, with a digest of
every other field that can change a forward pass), the dtypes, the KV-cache dtype and scales, the block size and the
KV-cache groups' specs, the layout, the parallel sizes and our host format. The tiering spec mixes its digest into the
tiers' namespace and into the integrity checks' block identities, and a ``p2p`` peer with another one is refused
naming the first field that differs. Standard library only (vLLM's objects are read by attribute).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triton_offload._checks import FORMAT_VERSIONS, host_format_setting

__all__ = [
    "FINGERPRINT_VERSION",
    "AUTO",
    "OFF",
    "IGNORED_CONFIG_KEYS",
    "ConfigFingerprint",
    "fingerprint_setting",
    "fingerprint_fields",
    "offloading_fields",
    "spec_fingerprint",
    "weights_identity",
]

logger = logging.getLogger(__name__)

FINGERPRINT_VERSION = 2  # 2: the host format's name and version in host_format
AUTO, OFF = "auto", "off"
# config.json keys that never change a K or V value: names, versions, token ids, generation (sampling) defaults,
# training-only settings (initialisation, dropout) and Hugging Face's own runtime flags. Every other key is in the
# ``config`` field's digest: a key unknown here changes the fingerprint (a miss, never a wrong load).
IGNORED_CONFIG_KEYS = frozenset(
    {
        "_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
        "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript", "torch_dtype", "dtype",
        "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "bad_words_ids",
        "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "num_beams", "num_beam_groups", "num_return_sequences",
        "early_stopping", "diversity_penalty", "generation_config", "initializer_range", "initializer_factor",
        "attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout",
        "embd_pdrop", "resid_pdrop", "attn_pdrop", "chunk_size_feed_forward", "is_encoder_decoder",
    }
)  # fmt: skip
# config.json keys of the named fields (besides those read through vLLM's model config).
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rotary_dim",
              "rotary_emb_base", "rope_interleave", "max_position_embeddings")  # fmt: skip
_ATTENTION_KEYS = ("layer_types", "attention_chunk_size", "no_rope_layers", "use_qk_norm", "qk_layernorm",
                   "attn_logit_softcapping", "query_pre_attn_scalar", "attention_bias", "sliding_window_pattern",
                   "use_sliding_window", "max_window_layers")  # fmt: skip
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# Weight files: names, sizes, safetensors headers and these many bytes from each end of the data are hashed.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE_BYTES = 64 << 10
_WIRE_VALUE_CHARS = 160  # a field's value travels to p2p peers as it is up to this length, else as a digest


def fingerprint_setting(value: Any) -> str:
    """``config_fingerprint``: ``"auto"`` (computed), ``"off"`` (vLLM's namespace alone) or a label of 1-64 letters,
    digits, ``-``, ``_`` or ``.`` that replaces the computed fingerprint (every instance with the same label shares)."""
    if value in (AUTO, OFF):
        return value
    if not isinstance(value, str) or not 0 < len(value) <= 64 or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(
            f"config_fingerprint = {value!r}: expected 'auto' (the default), 'off', or a label of 1-64 letters, "
            "digits, '-', '_' or '.' shared by the instances whose KV is the same (docs/tiering.md, 'Configuration "
            "fingerprint')"
        )
    return value


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data: dataclasses and mappings as dicts, enums by name, anything else by ``str``."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", str(value))  # never an address: it differs between processes


def _canonical(value: Any) -> str:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _digest(text: str, size: int = 8) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


@dataclass(frozen=True)
class ConfigFingerprint:
    """Named fields, in order, each a canonical JSON value; or, with ``label`` (``config_fingerprint`` set to a
    label), that label in place of the fields for every use below (the fields stay for the log).

    Attributes:
        fields: ``(name, canonical JSON)`` pairs.
        label: the explicit override, or None.
    """

    fields: tuple[tuple[str, str], ...]
    label: str | None = None

    @classmethod
    def of(cls, fields: Mapping[str, Any], label: str | None = None) -> ConfigFingerprint:
        return cls(tuple((name, _canonical(value)) for name, value in fields.items()), label)

    def with_fields(self, **more: Any) -> ConfigFingerprint:
        """These fields added after the others (a field already present keeps its place, with the new value)."""
        fields = dict(self.fields)
        fields.update((name, _canonical(value)) for name, value in more.items())
        return ConfigFingerprint(tuple(fields.items()), self.label)

    @property
    def digest(self) -> str:
        """16 hex digits: of the label if there is one, else of every field."""
        if self.label is not None:
            return _digest(f"label:{self.label}")
        return _digest(_canonical(dict(self.fields)))

    @property
    def person(self) -> bytes:
        """16 bytes for BLAKE2b's ``person`` parameter: what the block identities mix in
        (:func:`triton_offload.integrity.identities_of_keys`)."""
        return bytes.fromhex(_digest(f"identity:{self.digest}"))

    @property
    def namespace(self) -> str:
        """The suffix of the model name the tiers build their namespace from."""
        return f"+cfg-{self.digest}"

    def wire(self) -> str:
        """What a ``p2p`` peer is sent: each field's value (a digest where it is long), or the label."""
        if self.label is not None:
            return json.dumps({"label": self.label}, separators=(",", ":"))
        short = {n: v if len(v) <= _WIRE_VALUE_CHARS else json.dumps(f"digest:{_digest(v)}") for n, v in self.fields}
        return "{" + ",".join(f"{json.dumps(n)}:{v}" for n, v in short.items()) + "}"

    def difference(self, remote_wire: str) -> str | None:
        """None where a peer's :meth:`wire` matches ours, else a sentence naming the first field that differs (a key
        inside it, for a field that is a mapping on both sides)."""
        ours = json.loads(self.wire())
        try:
            theirs = json.loads(remote_wire)
        except ValueError:
            return f"the peer's configuration fingerprint {remote_wire[:80]!r} is not ours' kind"
        if not isinstance(theirs, dict):
            return f"the peer's configuration fingerprint {remote_wire[:80]!r} is not ours' kind"
        if ours == theirs:
            return None
        if "label" in ours or "label" in theirs:
            return (
                f"config_fingerprint differs: remote={theirs.get('label', 'computed')!r}, "
                f"local={ours.get('label', 'computed')!r}"
            )
        name, mine, other = "", ours, theirs
        while isinstance(mine, dict) and isinstance(other, dict):  # down to the first key that differs
            key = next(k for k in [*mine, *(k for k in other if k not in mine)] if mine.get(k) != other.get(k))
            name, mine, other = f"{name}.{key}" if name else key, mine.get(key), other.get(key)
        return f"configuration field {name!r} differs: remote={other!r}, local={mine!r}"

    def describe(self) -> str:
        """One line for the log: the digest and every field."""
        override = f" (config_fingerprint = {self.label!r}: used in place of the fields)" if self.label else ""
        fields = "; ".join(f"{n}={v if len(v) <= 200 else 'digest:' + _digest(v)}" for n, v in self.fields)
        return f"{self.digest}{override}: {fields}"


def weights_identity(model: str, revision: str | None = None) -> str:
    """The weights' identity: for a local directory (or file), a digest of its weight files' names, sizes,
    safetensors headers and the first and last 64 KiB of their data (modification times differ between copies of the
    same files: not used); for a hub model, the revision vLLM resolved (a commit), else ``"unpinned"``."""
    if os.path.isfile(model):
        files = [model]
    elif os.path.isdir(model):
        files = sorted(
            os.path.join(model, n)
            for n in os.listdir(model)
            if n.endswith(_WEIGHT_SUFFIXES) or n.endswith(".index.json")
        )
    else:
        return f"revision:{revision or 'unpinned'}"
    h = hashlib.blake2b(digest_size=8)
    for path in files:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size};".encode())
        with open(path, "rb") as f:
            start = 0
            if path.endswith(".safetensors") and size >= 8:
                header = int.from_bytes(f.read(8), "little")
                start = 8 + min(header, size - 8)
                h.update(f.read(start - 8))
            f.seek(start)
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(max(start, size - _SAMPLE_BYTES))
            h.update(f.read(_SAMPLE_BYTES))
    return f"files:{len(files)}:{h.hexdigest()}"


def _config_dict(config: Any) -> dict:
    if config is None:
        return {}
    to_dict = getattr(config, "to_dict", None)
    return dict(to_dict()) if to_dict is not None else dict(vars(config))


def _pick(config: dict, keys) -> dict:
    return {k: config[k] for k in keys if config.get(k) is not None}


def _call(obj: Any, name: str, *args) -> Any:
    method = getattr(obj, name, None)
    return method(*args) if method is not None else None


def _group_specs(kv_cache_config) -> list:
    """Each KV-cache group's spec, as the scheduler's copy of vLLM's config has it (a group of per-layer specs by its
    first layer's: every process then computes the same fields)."""
    specs = []
    for group in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        specs.append(next(iter(per_layer.values())) if per_layer else spec)
    return specs


def fingerprint_fields(vllm_config, kv_cache_config=None, offloading_config=None) -> dict[str, Any]:
    """The fields, in order, from vLLM's ``VllmConfig`` (its ``KVCacheConfig`` for the groups' specs, its
    ``OffloadingConfig`` for the layout vLLM resolved). Sampling settings, scheduling, memory sizes and seeds are not
    in vLLM's configs' KV-shaping parts, so not here."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    text = _config_dict(getattr(model, "hf_text_config", None))
    whole = _config_dict(getattr(model, "hf_config", None))
    specs = _group_specs(kv_cache_config)
    quant = getattr(model, "quantization", None)
    return {
        "model": model.model,
        "weights": weights_identity(model.model, getattr(model, "revision", None)),
        "architecture": {"architectures": whole.get("architectures"), "model_type": whole.get("model_type")},
        "rope": _pick(text, _ROPE_KEYS),
        "num_attention_heads": _call(model, "get_total_num_attention_heads") or text.get("num_attention_heads"),
        "num_kv_heads": _call(model, "get_total_num_kv_heads"),
        "head_dim": _call(model, "get_head_size"),
        "sliding_window": {
            "model": _call(model, "get_sliding_window"),
            "cache": getattr(cache, "sliding_window", None),
        },
        "attention": {"use_mla": getattr(model, "use_mla", None), **_pick(text, _ATTENTION_KEYS)},
        "mla": _pick(text, _MLA_KEYS),
        "quantization": {"method": quant, "config": whole.get("quantization_config")},
        "dtype": str(model.dtype),
        "kv_cache_dtype": {
            "cache_dtype": cache.cache_dtype,
            "resolved": [str(getattr(s, "dtype", None)) for s in specs],
            "quant_mode": [_plain(getattr(s, "kv_quant_mode", None)) for s in specs],
            "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None),
            "skip_layers": list(getattr(cache, "kv_cache_dtype_skip_layers", None) or ()),
        },
        "block_size": [getattr(s, "block_size", None) for s in specs] or cache.block_size,
        "kv_cache_spec": specs,
        "layout": getattr(offloading_config, "kv_cache_layout", None),
        "parallel": {
            "tp": parallel.tensor_parallel_size,
            "pp": parallel.pipeline_parallel_size,
            "pcp": getattr(parallel, "prefill_context_parallel_size", 1),
            "dcp": getattr(parallel, "decode_context_parallel_size", 1),
            "replicated_layout": getattr(offloading_config, "replicated_layout", None),
        },
        "config": _digest(_canonical({k: v for k, v in whole.items() if k not in IGNORED_CONFIG_KEYS}), 16),
    }


def offloading_fields(config) -> dict[str, Any]:
    """What an ``OffloadingConfig`` alone says (where vLLM's full config could not be read): the model's name, the KV
    dtype, the groups' block sizes and the parallel sizes."""
    p = config.parallel
    return {
        "model": config.model.name,
        "kv_cache_dtype": config.model.dtype,
        "block_size": [g.tokens_per_block for g in config.groups],
        "layout": getattr(config, "kv_cache_layout", None),
        "parallel": {
            "tp": p.tp_size,
            "pp": p.pp_size,
            "pcp": p.pcp_size,
            "dcp": p.dcp_size,
            "replicated_layout": getattr(config, "replicated_layout", None),
        },  # fmt: skip
    }


def spec_fingerprint(config, fields: Mapping[str, Any] | None, setting: str, *, host_format: str, **host_fields: Any):
    """A tiering spec's fingerprint, logged: ``fields`` (vLLM's, from :func:`fingerprint_fields`; None: what the
    ``OffloadingConfig`` ``config`` says, with a warning) plus our bytes' format: the ``host_format`` and its version
    (triton_offload/host_format.py) with ``host_fields`` (the layout, the integrity trailer, ...). None with
    ``setting`` ``"off"``; with a label, the label stands for it (both warned of: blocks of other configurations
    may then be loaded)."""
    if fields is None:
        logger.warning(
            "triton-offload: the configuration fingerprint is read from vLLM's offloading config only (model name, KV "
            "dtype, block sizes, parallel sizes): install the package so that its vLLM plugin entry point runs, for "
            "the weights, RoPE, heads and the other fields (docs/tiering.md, 'Configuration fingerprint')"
        )
        fields = offloading_fields(config)
    label = None if setting in (AUTO, OFF) else setting
    fmt = {"format": host_format, "format_version": FORMAT_VERSIONS[host_format_setting(host_format)]}
    fp = ConfigFingerprint.of(fields, label).with_fields(
        host_format={"version": FINGERPRINT_VERSION, **fmt, **host_fields}
    )
    if setting == OFF:
        logger.warning(
            "triton-offload: config_fingerprint = 'off': the tiers' namespace is vLLM's alone (model name, KV dtype, "
            "block size, parallel sizes), so blocks another configuration of this model stored (another RoPE, other "
            "weights under the same name, ...) are loaded as this one's. This configuration: %s",
            fp.describe(),
        )
        return None
    if label is not None:
        logger.warning(
            "triton-offload: config_fingerprint = %r: every instance with this label shares the tiers' blocks, "
            "whatever its configuration; they must all compute the same KV. This configuration: %s",
            label,
            fp.describe(),
        )
    else:
        logger.info("triton-offload configuration fingerprint %s", fp.describe())
    return fp


# vLLM >= 0.33 publishes static facts as labels of ``vllm:kv_offload_config_info``: the tiering spec adds this one.
INFO_KEY = "triton_offload_config_fingerprint"


@functools.cache
def _info_class(base: type) -> type:
    @dataclasses.dataclass(frozen=True)
    class FingerprintedInfo(base):
        triton_offload_config_fingerprint: str = "off"

    return FingerprintedInfo


def with_fingerprint_label(info: Any, fingerprint: ConfigFingerprint | None) -> Any:
    """vLLM's ``ConfigInfo`` dataclass ``info`` (its CPU tier's) with one more field, :data:`INFO_KEY`: the digest,
    or ``off`` where the fingerprint is off."""
    values = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    return _info_class(type(info))(**values, triton_offload_config_fingerprint=getattr(fingerprint, "digest", "off"))
