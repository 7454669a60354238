"""bench/call_cost.py's switching of the public calls' direct launch (the whole script runs in
tests/bench/test_bench_cpu.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from bench.micro import call_cost


@pytest.mark.parametrize("prior", [None, "0", "1"], ids=["unset", "off", "on"])
def test_public_calls_switch_the_direct_launch_and_put_the_callers_setting_back(monkeypatch, prior):
    """Each call sees the switch asked for; afterwards the variable is as the caller had it (unset stays unset)."""
    env = call_cost.FAST_LAUNCH_ENV
    if prior is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, prior)
    seen = []
    record = lambda *args: seen.append(os.environ.get(env))  # noqa: E731
    monkeypatch.setattr(call_cost, "to", SimpleNamespace(gather_blocks=record, scatter_blocks=record))
    s = SimpleNamespace(spec=None, g=None, host=None, h=None, device=torch.device("cpu"))
    for fast in (True, False):
        seen.clear()
        rows = call_cost.public_calls(s, 3, fast)
        assert seen == ["1" if fast else "0"] * 8  # the warm-up pair, then 3 timed calls of each
        assert len(rows) == 2 and all(r["calls"] == 3 for r in rows.values())
        assert os.environ.get(env) == prior
