"""Test-only subclass of the supported p2p tier (``triton_offload.connector.p2p_tier.P2PTier``: vLLM's p2p tier with
NIXL's progress thread paused and a bounded ZMQ linger) for the producer of tests/e2e/test_vllm_p2p_e2e.py that must die
in the middle of a fetch, loaded as an out-of-tree tier (``{"type": "TestP2PTier", "module_path": "vllm_p2p_tiers",
...}``, this directory on PYTHONPATH). The other engines of that test run ``P2PTier`` itself, as docs/tiering.md's
recipe gives it. One thing differs here:

- **A fetch can stall, on purpose.** For a ``kv_request_id`` starting with ``STALL_PREFIX``, the producer submits the
  NIXL write as usual, then writes that id to the file named by ``$P2P_STALL_MARKER`` and blocks its scheduler thread
  for up to ``STALL_BOUND_S``: the bytes may land at the consumer but the message that completes its load never
  leaves. The test SIGKILLs the producer meanwhile: a peer dying in the middle of a fetch, reproducibly.
"""

from __future__ import annotations

import os
import pathlib
import time

from triton_offload.connector.p2p_tier import P2PTier

STALL_PREFIX = "stall"
STALL_MARKER_ENV = "P2P_STALL_MARKER"
STALL_BOUND_S = 120.0


class TestP2PTier(P2PTier):
    """``P2PTier``, with fetches for ``STALL_PREFIX`` ids stalled after their transfer is submitted."""

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
