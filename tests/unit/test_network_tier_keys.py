"""The p2p tier's unknown-key message lists the keys the tier's own constructor takes, in its order (vLLM 0.32 and
0.33): vLLM's class as its signature reads, and an out-of-tree subclass with its own parameters included."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.p2p.manager", reason="needs vLLM >= 0.32 with its p2p tier")

from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager  # noqa: E402

from triton_offload.connector import network_tiers  # noqa: E402
from triton_offload.connector.tiering_config import TritonTieringConfig  # noqa: E402

VLLM_P2P_KEYS = ["host", "port", "backends", "num_threads", "unbound_store_timeout_s"]


class ZonedP2PTier(P2PSecondaryTierManager):
    """An out-of-tree p2p tier with one key of its own (never built: only its signature is read)."""

    def __init__(
        self,
        offloading_spec,
        primary_kv_view,
        tier_type="p2p",
        host=None,
        port=None,
        backends=None,
        num_threads=4,
        unbound_store_timeout_s=60.0,
        zone="a",
        **kwargs,
    ):
        raise AssertionError("the configuration check builds no tier")


@pytest.fixture(autouse=True)
def nixl_installed(monkeypatch):
    """The check does not need NIXL itself: the tests run where it is not installed too."""
    monkeypatch.setattr(network_tiers, "_nixl_installed", lambda: True)


@pytest.mark.parametrize(
    "tier,accepted",
    [
        ({"type": "p2p"}, VLLM_P2P_KEYS),
        ({"type": "ZonedP2PTier", "module_path": __name__, "zone": "b"}, [*VLLM_P2P_KEYS, "zone"]),
    ],
    ids=["vllm", "subclass"],
)
def test_p2p_typo_message_lists_the_constructors_keys_in_order(tier, accepted):
    extra = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{**tier, "host": "127.0.0.1", "prot": 5702}]}
    message = (
        f"kv_connector_extra_config['secondary_tiers'][0] (type {tier['type']!r}) has unknown key(s) 'prot' "
        f"(did you mean 'port'?) (vLLM's p2p tier would ignore them silently); it accepts {accepted}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        TritonTieringConfig.from_extra_config(extra)
