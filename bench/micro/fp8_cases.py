"""What bench/micro/fp8.py measures and checks, apart from the timing: the page shapes (:data:`PAGES`), one page's bf16
caches with its two specs and pinned host buffers (:class:`Group`), the store and load calls every measurement makes
(:func:`store`, :func:`load`), the correctness check a group passes before it is timed (:func:`check_group`: the bf16
round trip byte for byte, the FP8 round trip within E4M3's bound, the FP8 host bytes of a few blocks equal to
kernels/reference_fp8.py), the ratios and the issue-63 target computed from the rows (:func:`ratio_rows`,
:func:`targets`), and the plot."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

import triton_offload as to
from bench.common.targets import target_result
from triton_offload.kernels.reference_fp8 import gather_fp8_ref

__all__ = ["Page", "PAGES", "CPU_PAGES", "Group", "build_group", "store", "load", "check_group", "ratio_rows",
           "targets", "plot_fp8"]  # fmt: skip

FP8 = "fp8_e4m3"
SENTINEL = 0xA5
TARGET_RATIO = 1.8  # issue 63: FP8's logical GB/s over bf16's, loads and stores, pages >= 8 KiB on an H100
TARGET_MIN_PAGE = 8 << 10
REF_BLOCKS = 4  # blocks whose FP8 host bytes are compared with the reference


class Page(NamedTuple):
    """One layer's page of one GPU block: ``tokens`` x ``heads`` x ``head_dim`` bf16 values for K and for V."""

    tokens: int
    heads: int
    head_dim: int

    @property
    def name(self) -> str:
        return f"{self.tokens}x{self.heads}x{self.head_dim}"

    @property
    def page_bytes(self) -> int:  # K and V, bf16
        return 2 * 2 * self.tokens * self.heads * self.head_dim


# 2 KiB to 256 KiB per layer-block, heads and head dims of real models (16-token blocks; 8 tokens for the 2 KiB page).
PAGES = (Page(8, 1, 64), Page(16, 1, 64), Page(16, 1, 128), Page(16, 2, 128), Page(16, 8, 64), Page(16, 8, 128),
         Page(16, 32, 128))  # fmt: skip
CPU_PAGES = (Page(16, 1, 32), Page(16, 2, 64))  # the CPU check's: the interpreter is slow
LAYOUTS = ("kv_first", "block_first")


def cache_shape(layout: str, num_blocks: int, page: Page) -> tuple[int, ...]:
    inner = (page.tokens, page.heads, page.head_dim)
    if layout == "kv_first":
        return (2, num_blocks, *inner)
    if layout == "block_first":
        return (num_blocks, 2, *inner)
    raise ValueError(f"layout {layout!r}: kv_first or block_first")


def make_caches(page: Page, layout: str, layers: int, num_blocks: int, device: torch.device, seed: int):
    """bf16 caches of normal values, each head scaled by its own power of two in 2**-6..2**6 (real heads differ)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(layers):
        shape = cache_shape(layout, num_blocks, page)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        exps = torch.randint(-6, 7, (*shape[:2], 1, page.heads, 1), generator=gen, device=device)
        out.append(x.mul_(torch.exp2(exps.float())).to(torch.bfloat16))
    return out


@dataclass
class Group:
    """One page in one layout: the caches, a native and an FP8 spec over them, a pinned host buffer per format
    (rows filled with :data:`SENTINEL`), the store sources ``g_src``, the load destinations ``g_dst`` (distinct, random)
    and the host rows ``host_ids`` (random), f = 1."""

    page: Page
    layout: str
    caches: list
    specs: dict  # host format (None or FP8) -> KVCacheSpec
    hosts: dict  # host format -> (rows, host block bytes) uint8
    g_src: np.ndarray
    g_dst: np.ndarray
    host_ids: np.ndarray

    @property
    def n(self) -> int:
        return int(self.g_src.size)

    @property
    def layers(self) -> int:
        return len(self.caches)

    def logical_bytes(self) -> int:
        """The bf16 bytes of the KV one transfer moves: what both formats' logical GB/s count."""
        return self.n * self.specs[None].bytes_per_block

    def wire_bytes(self, host_format: str | None) -> int:
        """The bytes one transfer moves across the link: the host rows it writes or reads (scales and padding too)."""
        return self.n * self.specs[host_format].host_block_bytes(1)


def build_group(page: Page, layout: str, n: int, layers: int, device: torch.device, seed: int = 0) -> Group:
    """The caches (room for ``2 n`` blocks and a few more), both specs and both host buffers (pinned on CUDA)."""
    if n < REF_BLOCKS or layers < 1:
        raise ValueError(f"a group needs at least {REF_BLOCKS} blocks and one layer, got {n} blocks, {layers} layers")
    num_blocks = 2 * n + 8
    caches = make_caches(page, layout, layers, num_blocks, device, seed)
    specs = {None: to.KVCacheSpec(caches, layout), FP8: to.KVCacheSpec(caches, layout, host_format=FP8)}
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks).astype(np.int64)
    rows = n + 8
    hosts = {}
    for fmt, spec in specs.items():
        host = torch.empty((rows, spec.host_block_bytes(1)), dtype=torch.uint8, pin_memory=device.type == "cuda")
        hosts[fmt] = host.fill_(SENTINEL)
    host_ids = rng.permutation(rows)[:n].astype(np.int64)
    return Group(page, layout, caches, specs, hosts, perm[:n], perm[n : 2 * n], host_ids)


def store(group: Group, host_format: str | None, num_ctas: int | None = None) -> None:
    """Stores ``g_src`` of every layer into the format's host rows (asynchronous on CUDA, current stream)."""
    to.gather_blocks(group.specs[host_format], group.g_src, group.hosts[host_format], group.host_ids,
                     num_ctas=num_ctas)  # fmt: skip


def load(group: Group, host_format: str | None, num_ctas: int | None = None) -> None:
    """Loads the format's host rows into ``g_dst`` of every layer (asynchronous on CUDA, current stream)."""
    to.scatter_blocks(group.hosts[host_format], group.host_ids, group.specs[host_format], group.g_dst,
                      num_ctas=num_ctas)  # fmt: skip


def _blocks(cache: torch.Tensor, layout: str, ids: np.ndarray) -> torch.Tensor:
    idx = torch.as_tensor(ids, device=cache.device)
    return cache[:, idx] if layout == "kv_first" else cache[idx]


def _poison_destinations(group: Group) -> None:
    """NaN in every destination block, so a load that writes nothing (or only part) cannot pass."""
    idx = torch.as_tensor(group.g_dst, device=group.caches[0].device)
    for c in group.caches:
        c.index_fill_(1 if group.layout == "kv_first" else 0, idx, float("nan"))


def fp8_bound_excess(x: torch.Tensor, y: torch.Tensor) -> float:
    """How far the restored ``y`` exceeds E4M3's bound around ``x`` at worst (<= 0: within it; NaN anywhere in ``y``:
    inf). Per head (tokens x head_dim, its power-of-two scale s <= 2 amax / 448): |y - x| <= 2**-4 |x| + 2**-10 s."""
    x, y = x.double(), y.double()
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    amax = x.abs().amax(dim=(-3, -1), keepdim=True)
    scale = (amax / 448).clamp(min=2.0**-126) * 2
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale
    return float(((y - x).abs() - bound).max())


def _sync(group: Group) -> None:
    if group.caches[0].is_cuda:
        torch.cuda.synchronize(group.caches[0].device)


def _check_reference(group: Group) -> str | None:
    """The FP8 host rows of the first :data:`REF_BLOCKS` stored blocks against the reference, byte for byte."""
    k = REF_BLOCKS
    small = [_blocks(c, group.layout, group.g_src[:k]).cpu() for c in group.caches]
    want = torch.full((k, group.hosts[FP8].shape[1]), SENTINEL, dtype=torch.uint8)
    gather_fp8_ref(small, group.layout, np.arange(k), want, np.arange(k))
    got = group.hosts[FP8][torch.as_tensor(group.host_ids[:k])].cpu()
    if not torch.equal(got, want):
        return f"FP8 host bytes differ from the reference in {int((got != want).sum())} of {want.numel()} bytes"
    return None


def check_group(group: Group) -> list[str]:
    """Stores and loads once in each format and returns what is wrong (nothing: []): the bf16 copy's destinations
    must equal its sources byte for byte; the FP8 round trip must restore every value within E4M3's bound
    (:func:`fp8_bound_excess`) and its host rows of a few blocks must equal the reference's. Destinations are NaN
    before each load."""
    problems = []
    for fmt in (None, FP8):
        _poison_destinations(group)
        store(group, fmt)
        load(group, fmt)
        _sync(group)
        name = fmt or "bf16"
        for layer, c in enumerate(group.caches):
            src, dst = _blocks(c, group.layout, group.g_src), _blocks(c, group.layout, group.g_dst)
            if fmt is None and not torch.equal(src.view(torch.int16), dst.view(torch.int16)):
                problems.append(f"{name}: layer {layer}'s loaded blocks differ from the stored ones")
                break
            excess = fp8_bound_excess(src, dst) if fmt else 0.0
            if excess > 0:
                problems.append(f"{name}: layer {layer} restored beyond E4M3's bound (worst excess {excess:.3g})")
                break
        if fmt == FP8:
            problems += [p for p in (_check_reference(group),) if p]
    return problems


# -- what the rows say ----------------------------------------------------------------------------------------------


def _rate_ratio(a: dict | None, b: dict | None, wire: bool = False) -> float | None:
    """Row ``a``'s rate over row ``b``'s (logical bytes, or ``a``'s wire bytes), from the median times: GB/s are
    rounded, the times are not."""
    if not (a and b and a["median_ms"] and b["median_ms"]):
        return None
    return round(a["wire_bytes" if wire else "logical_bytes"] / b["logical_bytes"] * b["median_ms"] / a["median_ms"], 3)


def ratio_rows(rows: list[dict]) -> list[dict]:
    """Per page, layout and direction: bf16's and FP8's logical GB/s at the default programs, FP8's best tried
    (its programs), their ratios (FP8 / bf16: the same bf16 bytes, so the ratio of times), and each against the run's
    contiguous peak of the same direction and page (FP8 by its wire bytes); FP8 with the integrity checks against FP8
    without them (``checked_of_fp8``: 1.0 is free)."""
    cases: dict[tuple, dict] = defaultdict(dict)
    peaks = {(r["page"], r["direction"]): r for r in rows if r["method"] == "peak"}
    for r in rows:
        if r["method"] != "peak" and r.get("median_ms"):
            key = (r["page"], r["page_bytes"], r["layout"], r["direction"])
            cases[key].setdefault(r["method"], []).append(r)
    out = []
    for (page, page_bytes, layout, direction), by in sorted(cases.items(), key=lambda kv: (kv[0][1], kv[0][2:])):
        bf16 = next((r for r in by.get("bf16", []) if r["default"]), None)
        fp8 = by.get("fp8", [])
        default = next((r for r in fp8 if r["default"]), None)
        best = min(fp8, key=lambda r: r["median_ms"], default=None)
        peak = peaks.get((page, direction))
        checked = next(iter(by.get("fp8+checks", [])), None)
        rate = lambda r: r and r["logical_gbps"]  # noqa: E731
        out.append({"page": page, "page_bytes": page_bytes, "layout": layout, "direction": direction,
                    "bf16_gbps": rate(bf16), "fp8_default_gbps": rate(default), "fp8_best_gbps": rate(best),
                    "fp8_best_num_ctas": best and best["num_ctas"], "ratio_default": _rate_ratio(default, bf16),
                    "ratio_best": _rate_ratio(best, bf16), "peak_gbps": rate(peak),
                    "bf16_of_peak": _rate_ratio(bf16, peak),
                    "fp8_wire_of_peak": _rate_ratio(default, peak, wire=True),
                    "fp8_checked_gbps": rate(checked), "checked_of_fp8": _rate_ratio(checked, default)})  # fmt: skip
    return out


def targets(ratios: list[dict]) -> list[dict]:
    """Issue 63's speed goal over the ratio rows: >= 1.8x at pages >= 8 KiB, at FP8's default programs and at its best
    tried (both against bf16 at its default); n/a where nothing was timed."""
    where = lambda r: f"{r['page']} {r['layout']} {r['direction']}"  # noqa: E731
    big = [r for r in ratios if r["page_bytes"] >= TARGET_MIN_PAGE]
    text = f"FP8 logical GB/s >= {TARGET_RATIO}x bf16's, pages >= {TARGET_MIN_PAGE >> 10} KiB"
    which = (("default", "default programs", "ratio_default"), ("best", "best tried programs", "ratio_best"))
    return [target_result(f"{text} ({what})", [(r[key], where(r)) for r in big if r[key] is not None],
                          lambda v: v >= TARGET_RATIO) | {"key": f"fp8_{name}"}
            for name, what, key in which]  # fmt: skip


_STYLE = {"bf16": dict(color="tab:blue", marker="o"), "fp8": dict(color="tab:red", marker="s"),
          "fp8 best": dict(color="tab:red", marker="^", linestyle=":"),
          "peak": dict(color="black", linestyle="--", marker="_", markersize=14)}  # fmt: skip


def plot_fp8(ratios: list[dict], path: str, title: str) -> str | None:
    """Logical GB/s against page size, store and load, bf16 and FP8 (default and best tried programs) and the peak,
    averaged over layouts. Returns None, or why nothing was written."""
    if not any(r["bf16_gbps"] or r["fp8_default_gbps"] for r in ratios):
        return "nothing was timed: no plot written"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, direction in zip(axes, ("store", "load")):
        for label, key in (("bf16", "bf16_gbps"), ("fp8", "fp8_default_gbps"), ("fp8 best", "fp8_best_gbps"),
                           ("peak", "peak_gbps")):  # fmt: skip
            acc = defaultdict(list)
            for r in ratios:
                if r["direction"] == direction and r[key]:
                    acc[r["page_bytes"]].append(r[key])
            if acc:
                xs = sorted(acc)
                ax.plot([x / 1024 for x in xs], [sum(acc[x]) / len(acc[x]) for x in xs], label=label, **_STYLE[label])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("page size (KiB of bf16 per layer per GPU block, K+V)")
        ax.set_title(f"{direction}: {'GPU -> host' if direction == 'store' else 'host -> GPU'}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("logical GB/s (bf16 bytes of KV per second)")
    axes[0].legend(loc="best", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None
