"""The serving workload :mod:`bench.micro.manager` drives two scheduler-side managers through, in one process: a
simulated engine loop that calls vLLM's ``OffloadingManager`` API the way vLLM's offloading connector does (a lookup
per key up to the first miss, ``prepare_load`` of the hits, ``prepare_store`` of each request's newly computed
blocks, ``complete_store`` / ``complete_load`` of last step's jobs with the keys as a set, ``on_request_finished``),
on a full cache so that every store evicts. Both managers get the same calls: the loads use the smaller of their two
hit counts, and which manager goes first alternates every step. Each call is timed on its own (the thread's CPU time
by default, so that a shared machine's descheduling is not billed to whichever side it hits); the engine's own work
is not timed. The request mix: ``requests`` running, prompts of 1k-32k tokens (log-uniform), 70 % starting with one
of 64 shared prefixes of 1k-16k tokens (Zipf popularity), 20 % continuing a finished request's conversation, 16-token
GPU blocks and host blocks of 4 (one key per 64 tokens), a 16k-token budget per step, decodes of 32-512 tokens.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import deque

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

__all__ = ["TOKENS_PER_KEY", "OPS", "Engine", "fill", "new_keys"]

TOKENS_PER_KEY = 64  # 16-token GPU blocks, 4 per host block
OPS = ("lookup", "touch", "prepare_load", "prepare_store", "complete_store", "complete_load", "on_request_finished")
_PREFIXES = 64
_BUDGET = 16_384
_HISTORY = 2048  # finished conversations a new request may continue


def new_keys(start: int, count: int, tag: int = 0) -> list[bytes]:
    """``count`` distinct 36-byte ``OffloadKey``s (a 32-byte hash and the group index), numbered from ``start``."""
    return [
        make_offload_key(tag.to_bytes(4, "little") + i.to_bytes(28, "little"), 0) for i in range(start, start + count)
    ]


def fill(manager, keys: list[bytes], batch: int = 4096) -> None:
    """Stores ``keys`` into ``manager`` (untimed), ``batch`` per call, each store completed at once."""
    rc = ReqContext(req_id="")
    for i in range(0, len(keys), batch):
        out = manager.prepare_store(keys[i : i + batch], rc)
        assert out is not None, "no room to fill the cache"
        manager.complete_store(set(out.keys_to_store), rc)


class _Request:
    """One request; ``rcs`` holds its ``ReqContext`` for each side (a manager keeps its per-request state there, and
    two managers of one class would overwrite each other's)."""

    __slots__ = ("rcs", "keys", "prompt_tokens", "computed", "stored", "decode_len")

    def __init__(self, name: str, keys: list[bytes], decode_len: int):
        self.rcs = (ReqContext(req_id=name), ReqContext(req_id=name))
        self.keys, self.prompt_tokens, self.decode_len = keys, len(keys) * TOKENS_PER_KEY, decode_len
        self.computed = self.stored = 0
        self.position(0)

    def position(self, start: int) -> None:
        """Records the end token of the keys from ``start`` on, as vLLM's scheduler does."""
        for rc in self.rcs:
            for i in range(start, len(self.keys)):
                rc.set_offload_key_position(self.keys[i], (i + 1) * TOKENS_PER_KEY)


class Engine:
    """One simulated engine feeding two managers (``a`` and ``b``) the same calls; :meth:`step` returns each side's
    per-call times of one step as ``{op: [(ns, keys), ...]}``."""

    def __init__(self, a, b, *, requests: int = 256, seed: int = 0, touch: bool = True, clock=time.thread_time_ns):
        self.sides, self.clock = (a, b), clock
        self.rng = random.Random(seed)
        self.touch = touch
        self.max_running = requests
        self.running: list[_Request] = []
        self.finished: list[_Request] = []
        self.history: deque[list[bytes]] = deque(maxlen=_HISTORY)
        self.jobs: tuple[list, list] = ([], [])  # per side: (kind, keys, rc) to complete next step
        self.next_id = 0
        self.next_key = 0
        self.steps = 0
        prefix_tokens = [int(math.exp(self.rng.uniform(math.log(1024), math.log(16384)))) for _ in range(_PREFIXES)]
        self.prefixes = [self._fresh_keys(t // TOKENS_PER_KEY, tag=1) for t in prefix_tokens]
        weights = [1 / (i + 1) for i in range(_PREFIXES)]  # Zipf
        self.prefix_cum = [sum(weights[: i + 1]) / sum(weights) for i in range(_PREFIXES)]

    def _fresh_keys(self, count: int, tag: int = 2) -> list[bytes]:
        keys = new_keys(self.next_key, count, tag)
        self.next_key += count
        return keys

    def _new_request(self) -> _Request:
        rng = self.rng
        tokens = int(math.exp(rng.uniform(math.log(1024), math.log(32768))))
        draw = rng.random()
        if draw < 0.7:
            head = self.prefixes[min(bisect.bisect_left(self.prefix_cum, rng.random()), _PREFIXES - 1)]
        elif draw < 0.9 and self.history:
            head = self.history[rng.randrange(len(self.history))]
        else:
            head = []
        own = max(1, tokens // TOKENS_PER_KEY - len(head))
        self.next_id += 1
        return _Request(f"r{self.next_id}", head + self._fresh_keys(own), rng.randint(32, 512))

    def _timed(self, side: int, out: dict, op: str, fn, *args):
        start = self.clock()
        result = fn(*args)
        out[side][op].append((self.clock() - start, len(args[0]) if op != "on_request_finished" else 0))
        return result

    def step(self) -> tuple[dict, dict]:
        """One engine step; returns each side's ``{op: [(ns, keys)]}``."""
        out = ({op: [] for op in OPS}, {op: [] for op in OPS})
        order = (0, 1) if self.steps % 2 == 0 else (1, 0)
        self.steps += 1
        for side in order:  # last step's jobs complete, as vLLM reports them: a set of keys per job
            for kind, keys, req in self.jobs[side]:
                self._timed(side, out, kind, getattr(self.sides[side], kind), set(keys), req.rcs[side])
            self.jobs[side].clear()
        for req in self.finished:
            for side in order:
                self._timed(side, out, "on_request_finished", self.sides[side].on_request_finished, req.rcs[side])
            self.history.append(req.keys)
        self.finished.clear()
        while len(self.running) < self.max_running:
            self._arrive(self._new_request(), order, out)
        self._schedule(order, out)
        return out

    def _arrive(self, req: _Request, order, out) -> None:
        hits = []
        for side in order:
            lookup, rc, n = self.sides[side].lookup, req.rcs[side], 0
            start = self.clock()
            for key in req.keys:
                if lookup(key, rc) is not LookupResult.HIT:
                    break
                n += 1
            out[side]["lookup"].append((self.clock() - start, min(n + 1, len(req.keys))))
            hits.append(n)
        n = min(hits)
        if n:
            load = req.keys[:n]
            for side in order:
                if self.touch:
                    self._timed(side, out, "touch", self.sides[side].touch, load, req.rcs[side])
                self._timed(side, out, "prepare_load", self.sides[side].prepare_load, load, req.rcs[side])
                self.jobs[side].append(("complete_load", load, req))
        req.computed, req.stored = n * TOKENS_PER_KEY, n
        self.running.append(req)

    def _schedule(self, order, out) -> None:
        budget = _BUDGET
        still = []
        for req in self.running:  # decodes first, then prefill chunks in arrival order
            if req.computed >= req.prompt_tokens:
                req.computed += 1
                budget -= 1
        for req in self.running:
            if req.computed < req.prompt_tokens and budget > 0:
                take = min(budget, req.prompt_tokens - req.computed)
                req.computed += take
                budget -= take
            done = req.computed // TOKENS_PER_KEY
            if done > len(req.keys):  # a generated block is full: it gets a key of its own
                start = len(req.keys)
                req.keys += self._fresh_keys(done - start, tag=3)
                req.position(start)
            if done > req.stored:
                keys = req.keys[req.stored : done]
                req.stored = done
                for side in order:
                    res = self._timed(side, out, "prepare_store", self.sides[side].prepare_store, keys, req.rcs[side])
                    if res is not None and res.keys_to_store:
                        self.jobs[side].append(("complete_store", list(res.keys_to_store), req))
            if req.computed >= req.prompt_tokens + req.decode_len:
                self.finished.append(req)
            else:
                still.append(req)
        self.running = still
