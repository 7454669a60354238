"""vLLM's ``p2p`` tier (an instance fetches a prefix from another instance's CPU tier over NIXL), with the two settings
that make it usable on vLLM 0.32 where cores are few (:class:`P2PTier`): NIXL's progress thread pauses between polls
(``progress_pause_us``, default 100), and its ZMQ sockets linger at most 500 ms (vLLM 0.33's setting). Everything else
(handshake, lookups, fetches, NIXL transfers, failure handling) is vLLM's code. What this does not change: a p2p tier
always reports pending work, so vLLM's engine core steps back to back for as long as it lives
(docs/tiering.md, "What it costs").
"""

from __future__ import annotations

import contextlib
import inspect
import types

from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

from triton_offload._checks import positive_int

__all__ = ["P2PTier", "DEFAULT_PROGRESS_PAUSE_US", "LINGER_MS"]

DEFAULT_PROGRESS_PAUSE_US = 100
LINGER_MS = 500  # vLLM 0.33's _DEALER_LINGER_MS


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


# vLLM's keys and ours: the spec's configuration check reads a tier's accepted keys from its constructor's signature.
_VLLM_PARAMS = list(inspect.signature(P2PSecondaryTierManager.__init__).parameters.values())
P2PTier.__init__.__signature__ = inspect.Signature(
    [p for p in _VLLM_PARAMS if p.kind is not p.VAR_KEYWORD]
    + [inspect.Parameter("progress_pause_us", inspect.Parameter.KEYWORD_ONLY, default=DEFAULT_PROGRESS_PAUSE_US)]
    + [p for p in _VLLM_PARAMS if p.kind is p.VAR_KEYWORD]
)
