"""The benchmarks' terminal tables (bench/common/report.py) under rich: a long prose column wraps instead of squeezing
the labels before it into ellipses (the serving CPU check's table did, in `./dev bench`'s piped output)."""

from __future__ import annotations

import io

import pytest

from bench.common import report

pytestmark = pytest.mark.skipif(not report.RICH, reason="rich is in the bench extra")

LABELS = ["decode-heavy", "2KiB", "async", "triton_size_aware", "pass"]
PROSE = (
    "the same kernel with launch_shape='size-aware': programs chosen from the caches' page runs (16 below 4 KiB, "
    "8 below 8 KiB, else the default 4; never above num_ctas); the probe of whether it should become the default"
)


def _printed(monkeypatch, **kwargs) -> str:
    from rich.console import Console

    out = io.StringIO()
    monkeypatch.setattr(report, "_console", Console(file=out, width=120, highlight=False, soft_wrap=True))
    columns = ["workload", "shape", "loads", "method", "byte check", "implementation"]
    report.print_table("t", columns, [[*LABELS, PROSE]], left=5, **kwargs)
    return out.getvalue()


def test_a_prose_last_column_wraps_and_every_label_stays_whole(monkeypatch):
    text = _printed(monkeypatch, wrap_last=True)
    assert all(label in text for label in LABELS), text
    assert "…" not in text, text
    words = " ".join(line.strip("│ ") for line in text.splitlines())
    assert all(word in words for word in ("size-aware':", "default", "num_ctas);")), text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_without_it_the_sentence_squeezes_the_labels(monkeypatch):
    """What wrap_last is for: every column unwrapped, the sentence takes the width and the labels lose their ends."""
    text = _printed(monkeypatch)
    assert "triton_size_aware" not in text and "…" in text, text
