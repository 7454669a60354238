"""GB/s against page size, one panel per direction, each method a line and the link's measured peak as the ceiling.
Usable on its own to re-plot results files; several files (the GPU runner's parts) are plotted together when they come
from one device and one default num_ctas.

    python -m bench.common.plot results.json [more.json ...] out.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from bench.common.results import PYTHON_ISSUED

__all__ = ["plot_results"]

# Drawn in this order; peak is the dashed ceiling.
_STYLE = {
    "triton": dict(color="tab:blue", marker="o", linewidth=2.2),
    "memcpy_batch": dict(color="tab:orange", marker="s"),
    "memcpy_per_block": dict(color="tab:red", marker="v"),
    "torch_staged": dict(color="tab:green", marker="^"),
    "vllm033": dict(color="tab:purple", marker="D"),
    "vllm_native": dict(color="tab:brown", marker="P"),
    "peak": dict(color="black", linestyle="--", marker="_", markersize=14),  # a lone page size still shows
}


def _series(rows: list[dict], direction: str, blocks: int, f: int, default_ctas: int) -> dict[str, list[tuple]]:
    """method -> [(page_bytes, GB/s)], averaged over layouts at each page size (triton at its default CTAs)."""
    acc: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["direction"] != direction or r["blocks"] != blocks or r["blocks_per_host_block"] != f:
            continue
        if r["gbps"] is None or (r["method"] == "triton" and r["num_ctas"] != default_ctas):
            continue
        acc[r["method"]][r["page_bytes"]].append(r["gbps"])
    return {m: sorted((p, sum(v) / len(v)) for p, v in pages.items()) for m, pages in acc.items()}


def plot_results(rows: list[dict], path: str, title: str, default_ctas: int) -> str | None:
    """Writes the PNG; returns None, or why nothing was written (no measured rows)."""
    measured = [r for r in rows if r.get("gbps") is not None]
    if not measured:
        return "no bandwidth was measured: no plot written"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = max(r["blocks"] for r in measured)
    f = min(r["blocks_per_host_block"] for r in measured)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, direction, label in zip(axes, ("store", "load"), ("store: GPU -> host", "load: host -> GPU")):
        series = _series(measured, direction, blocks, f, default_ctas)
        for method, style in _STYLE.items():
            points = series.get(method)
            if not points:
                continue
            xs, ys = zip(*points)
            name = f"triton ({default_ctas} CTAs)" if method == "triton" else method
            if any((r.get("impl") or "").startswith(PYTHON_ISSUED) for r in measured if r["method"] == method):
                name += " (Python-issued)"
            ax.plot([x / 1024 for x in xs], ys, label=name, **style)
        ax.set_xscale("log", base=2)
        pages = sorted({p for pts in series.values() for p, _ in pts})
        ax.set_xticks([p / 1024 for p in pages], [f"{p / 1024:g}" for p in pages])
        ax.minorticks_off()
        ax.set_xlabel("page size (KiB per layer per GPU block, K+V)")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    labelled = [ax for ax in axes if ax.get_legend_handles_labels()[0]]  # a run may have measured one direction
    labelled[0].legend(loc="best", fontsize=9)
    fig.suptitle(f"{title}\n{blocks} blocks per transfer, {f} GPU block(s) per host block, mean over layouts")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def merge_results(docs: list[dict]) -> tuple[list[dict], str, int]:
    """(rows, device, default num_ctas) of several results files of one device and one default.

    Raises:
        SystemExit: the files come from different devices or defaults (their numbers cannot share a plot).
    """
    devices = {d.get("device", "") for d in docs}
    defaults = {d.get("default_num_ctas") for d in docs}
    if len(devices) != 1 or len(defaults) != 1:
        raise SystemExit(f"results from different devices {sorted(devices)} or default num_ctas {sorted(defaults)}")
    return [r for d in docs for r in d["rows"]], devices.pop(), defaults.pop()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit("usage: python -m bench.common.plot RESULTS.json [MORE.json ...] OUT.png")
    docs = [json.loads(open(path).read()) for path in argv[:-1]]
    rows, device, default = merge_results(docs)
    why = plot_results(rows, argv[-1], f"{device} -- triton-offload", default)
    print(why or f"wrote {argv[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
