"""vLLM's ``p2p`` tier (an instance fetches a prefix from another instance's CPU tier over NIXL), with the two settings
that make it usable on vLLM 0.32 where cores are few (:class:`P2PTier`): NIXL's progress thread pauses between polls
(``progress_pause_us``, default 100), and its ZMQ sockets linger at most 500 ms (vLLM 0.33's setting); and, under
``TritonTieringOffloadingSpec``, a peer of another configuration refused at the handshake naming the first field of
the configuration fingerprint that differs. Everything else (handshake, lookups, fetches, NIXL transfers, failure
handling) is vLLM's code. What this does not change: a p2p tier always reports pending work, so vLLM's engine core
steps back to back for as long as it lives (docs/tiering.md, "What it costs").
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types

from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

from triton_offload._checks import positive_int

__all__ = ["P2PTier", "DEFAULT_PROGRESS_PAUSE_US", "LINGER_MS", "FINGERPRINT_SEPARATOR", "check_peer_fingerprint"]

logger = logging.getLogger(__name__)

DEFAULT_PROGRESS_PAUSE_US = 100
LINGER_MS = 500  # vLLM 0.33's _DEALER_LINGER_MS
# Between vLLM's fingerprint of its namespace fields and our fields in the handshake's config_fingerprint.
FINGERPRINT_SEPARATOR = "|triton-offload:"


def check_peer_fingerprint(session, fingerprint, msg: dict) -> bool:
    """Whether a peer's connect message may go on to vLLM's own checks: False (and the connection marked dead, the
    refusal logged as vLLM logs its own) where its chunk length matches ours but its configuration fingerprint does
    not, naming the first field that differs. vLLM compares its own fingerprint (a digest, which ours changes through
    the model name) and the chunk length itself: a peer without our fields, or of another chunk length, is left to it.
    """
    from vllm.v1.kv_offload.tiering.p2p.session.protocol import ConnectMsg

    remote = msg.get(ConnectMsg.CONFIG_FINGERPRINT)
    if not isinstance(remote, str) or FINGERPRINT_SEPARATOR not in remote:
        return True
    if msg.get(ConnectMsg.BLOCK_LEN) != session._local_block_len:
        return True
    why = fingerprint.difference(remote.split(FINGERPRINT_SEPARATOR, 1)[1])
    if why is None:
        return True
    logger.error(
        "P2PSession %s: rejecting peer connect: configuration fingerprint mismatch: %s (docs/tiering.md, "
        "'Configuration fingerprint')",
        session.peer_id,
        why,
    )
    if session._conn is not None:
        session._conn.mark_dead()
    return False


@contextlib.contextmanager
def _progress_threads_pausing(pause_us: int):
    """NIXL agents created meanwhile pause ``pause_us`` between progress-thread polls that made no progress.

    nixl's Python agent builds its binding's ``nixlAgentConfig`` from the module global ``nixlBind`` at call time and
    then sets ``pthrDelay = 0``: for the time of the block, that global is a view of the binding whose config class
    raises a smaller delay to ``pause_us``. Tiers are built one at a time by the scheduler; the binding is put back
    before anything else runs.
    """
    import nixl._api as api  # the wheel's real module (nixl_cu12._api), as vLLM's nixl_utils imports it

    real = api.nixlBind

    class PausedAgentConfig(real.nixlAgentConfig):
        def __setattr__(self, name, value):
            super().__setattr__(name, max(value, pause_us) if name == "pthrDelay" else value)

    class Binding(types.ModuleType):
        def __getattr__(self, name):
            return PausedAgentConfig if name == "nixlAgentConfig" else getattr(real, name)

    api.nixlBind = Binding(real.__name__)
    try:
        yield
    finally:
        api.nixlBind = real


class P2PTier(P2PSecondaryTierManager):
    """vLLM's p2p tier with NIXL's progress thread pausing ``progress_pause_us`` microseconds between idle polls (0:
    NIXL's own busy polling) and its ZMQ sockets lingering at most 500 ms.

    - **NIXL's progress thread pauses between polls** (``progress_pause_us``, default 100). nixl 1.5.1's Python agent
      starts that thread with no pause (``pthrDelay = 0``, hard-coded), so every p2p instance keeps one core busy,
      idle or not: 0.94 of a core for an idle agent on this project's 2-core VM, 0.02 with a 100 us pause. The pause
      applies to polls that made no progress; transfers complete as before (the p2p end-to-end tests run with it).
    - **Its ZMQ sockets linger at most 500 ms** (vLLM 0.33's setting). vLLM 0.32 keeps ZMQ's default (forever): once
      it has closed a connection with a message still queued for a peer that is gone, closing the tier at shutdown
      waits forever.

    Use it as an out-of-tree tier class, with vLLM's keys plus ``progress_pause_us``::

        "secondary_tiers": [{"type": "P2PTier", "module_path": "triton_offload.connector.p2p_tier",
                             "host": "10.0.0.5", "port": 5710, "backends": ["UCX"]}]
    """

    def __init__(self, *args, progress_pause_us: int = DEFAULT_PROGRESS_PAUSE_US, **kwargs):
        if progress_pause_us != 0:
            positive_int(progress_pause_us, "progress_pause_us")
        with _progress_threads_pausing(progress_pause_us) if progress_pause_us else contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        import zmq

        # Sockets created from now on (every peer connection's DEALER) inherit it.
        self._control._zmq_ctx.setsockopt(zmq.LINGER, LINGER_MS)
        self._fingerprint = getattr(kwargs.get("offloading_spec", args[0] if args else None), "fingerprint", None)
        if self._fingerprint is not None:
            # Sent in every connect message (vLLM's session sends its transport's string as it is and compares it
            # whole: a peer whose fields differ is refused by vLLM too, wherever our check does not run).
            data = self._data
            data._config_fingerprint = f"{data.config_fingerprint}{FINGERPRINT_SEPARATOR}{self._fingerprint.wire()}"

    def _checked(self, session):
        """``session`` with our check ahead of vLLM's on the peer's connect message (once per session)."""
        if session is None or self._fingerprint is None or getattr(session, "_fingerprint_checked", False):
            return session
        on_connect, fingerprint = session._on_connect, self._fingerprint

        def checked_on_connect(msg: dict) -> None:
            if check_peer_fingerprint(session, fingerprint, msg):
                on_connect(msg)

        session._on_connect, session._fingerprint_checked = checked_on_connect, True
        return session

    def _get_or_create_session(self, peer_id: str):
        return self._checked(super()._get_or_create_session(peer_id))

    def _accept_new_peers(self, new_connections) -> None:
        super()._accept_new_peers(new_connections)
        for session in list(self._sessions.values()):
            self._checked(session)


# vLLM's keys and ours: the spec's configuration check reads a tier's accepted keys from its constructor's signature.
_VLLM_PARAMS = list(inspect.signature(P2PSecondaryTierManager.__init__).parameters.values())
P2PTier.__init__.__signature__ = inspect.Signature(
    [p for p in _VLLM_PARAMS if p.kind is not p.VAR_KEYWORD]
    + [inspect.Parameter("progress_pause_us", inspect.Parameter.KEYWORD_ONLY, default=DEFAULT_PROGRESS_PAUSE_US)]
    + [p for p in _VLLM_PARAMS if p.kind is p.VAR_KEYWORD]
)
