"""Test-only subclass of vLLM's ``p2p`` tier for the engines of tests/test_vllm_p2p_e2e.py, loaded as an out-of-tree
tier (``{"type": "TestP2PTier", "module_path": "vllm_p2p_tiers", ...}``, this directory on PYTHONPATH). The handshake,
lookups, fetches, NIXL transfers and failure handling are vLLM's own code; three things differ:

- **NIXL's progress thread pauses.** nixl 1.5.1's Python agent starts its progress thread with no pause between polls
  (``pthrDelay = 0``, hard-coded), so every p2p instance keeps one core busy even when idle (measured on the CI-class
  2-core VM: 0.94 of a core for an idle agent, 0.02 with a 100 us pause). Three engines of a test would need three
  cores; importing this module makes agents created afterwards in this process pause ``NIXL_PAUSE_US`` between polls
  that made no progress (the thread still runs; transfers complete as before).
- **Its ZMQ sockets linger 500 ms, as vLLM 0.33's do.** vLLM 0.32 keeps the default (forever): once it has closed a
  connection with a message still queued for a peer that is gone (a dead or killed peer), closing the tier at
  shutdown waits forever in ZMQ's context termination (reproduced with vLLM 0.32's transport alone; 0.33's returns in
  0.45 s). docs/tiering.md tells users.
- **A fetch can stall, on purpose.** For a ``kv_request_id`` starting with ``STALL_PREFIX``, the producer submits the
  NIXL write as usual, then writes that id to the file named by ``$P2P_STALL_MARKER`` and blocks its scheduler thread
  for up to ``STALL_BOUND_S``: the bytes may land at the consumer but the message that completes its load never
  leaves. The test SIGKILLs the producer meanwhile: a peer dying in the middle of a fetch, reproducibly.
"""

from __future__ import annotations

import functools
import os
import pathlib
import time
import types

import zmq
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

NIXL_PAUSE_US = 100
STALL_PREFIX = "stall"
STALL_MARKER_ENV = "P2P_STALL_MARKER"
STALL_BOUND_S = 120.0
LINGER_MS = 500  # vLLM 0.33's _DEALER_LINGER_MS


def _pause_nixl_progress_threads() -> None:
    """Wraps the binding module nixl's Python API builds agents from, so that the ``pthrDelay = 0`` it sets becomes
    ``NIXL_PAUSE_US``."""
    import nixl._api as api  # the wheel's real module (nixl_cu12._api), as vLLM's nixl_utils imports it

    real = getattr(api.nixlBind, "_real", api.nixlBind)

    class PausedAgentConfig(real.nixlAgentConfig):
        def __setattr__(self, name, value):
            super().__setattr__(name, max(value, NIXL_PAUSE_US) if name == "pthrDelay" else value)

    class Bindings(types.ModuleType):
        _real = real

        def __getattr__(self, name):
            return PausedAgentConfig if name == "nixlAgentConfig" else getattr(real, name)

    api.nixlBind = Bindings(real.__name__)


_pause_nixl_progress_threads()


class TestP2PTier(P2PSecondaryTierManager):
    """vLLM's p2p tier, with NIXL's progress thread paused (module import), a bounded linger on its ZMQ sockets
    (vLLM 0.33's), and fetches for ``STALL_PREFIX`` ids stalled after their transfer is submitted."""

    @functools.wraps(P2PSecondaryTierManager.__init__)  # its keys, as the spec's configuration check reads them
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Sockets created from now on (every peer connection's DEALER) inherit it.
        self._control._zmq_ctx.setsockopt(zmq.LINGER, LINGER_MS)

    def _accept_new_peers(self, new_connections) -> None:
        super()._accept_new_peers(new_connections)
        for session in self._sessions.values():
            server = session._server
            if getattr(server, "_stalls", False):
                continue

            def submit_then_stall(kv_request_id, *args, _submit=server._submit_transfer, **kwargs):
                _submit(kv_request_id, *args, **kwargs)
                if kv_request_id.startswith(STALL_PREFIX):
                    pathlib.Path(os.environ[STALL_MARKER_ENV]).write_text(kv_request_id)
                    time.sleep(STALL_BOUND_S)

            server._submit_transfer = submit_then_stall
            server._stalls = True
