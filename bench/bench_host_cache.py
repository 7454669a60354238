"""What a large host cache costs to set up: allocation (an anonymous mapping, touched in parallel) and CUDA
registration, at several sizes, with the registration's chunks issued from one thread or several.

    python bench/bench_host_cache.py --sizes-gib 8 32 64 --threads 1 4 16 --json out.json

Each size is allocated and touched once (``HostCache(pin=False)``: ``alloc_s``), then registered and unregistered
once per thread count on that same memory (``register_host_range``, 1 GiB chunks): registration time does not depend
on which mapping it pins, and touching 64 GiB again per thread count would triple the run. GiB/s = size / seconds.
Without CUDA only the allocation is measured and the registration lists are empty. The JSON is rewritten after
every size.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from triton_offload.host_cache import REGISTER_CHUNK_BYTES, HostCache, register_host_range, unregister_host_ranges

# isort: split
# Sibling modules: bench/ is on sys.path when this runs as a script (it is not a package).
from report import print_table, say
from results import machine_info, write_json

GIB = 1 << 30
BLOCK_BYTES = 2 << 20  # any host block size: the cache is sized in bytes


def measure_size(nbytes: int, threads: list[int], cuda: bool) -> dict:
    """One size: allocation once, then register + unregister per thread count."""
    cache = HostCache(BLOCK_BYTES, nbytes, pin=False)
    alloc_s = cache.alloc_seconds  # the mapping and its parallel first touch, as HostCache times them
    out = {"gib": nbytes / GIB, "alloc_s": round(alloc_s, 3), "alloc_gibps": round(nbytes / GIB / alloc_s, 2)}
    runs = []
    if cuda:
        ptr = cache.buffer.data_ptr()
        for t in threads:
            t0 = time.perf_counter()
            ranges = register_host_range(ptr, cache.nbytes, threads=t, what="benchmark buffer")
            reg_s = time.perf_counter() - t0
            chunks = len(ranges)
            t0 = time.perf_counter()
            unregister_host_ranges(ranges)
            unreg_s = time.perf_counter() - t0
            runs.append(
                {
                    "threads": t,
                    "chunks": chunks,
                    "register_s": round(reg_s, 3),
                    "register_gibps": round(nbytes / GIB / reg_s, 2),
                    "unregister_s": round(unreg_s, 3),
                }
            )
    out["registration"] = runs
    cache.close()
    del cache
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[8, 32, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.empty(1, device="cuda")  # the context exists before the first registration is timed
    else:
        say("no CUDA: measuring the allocation only; registration needs a GPU", "yellow")
    results: list[dict] = []

    def write() -> None:
        if args.json:
            doc = {
                "benchmark": "host_cache",
                **machine_info(),
                "device": torch.cuda.get_device_name() if cuda else None,
                "torch": torch.__version__,
                "chunk_bytes": REGISTER_CHUNK_BYTES,
                "complete": len(results) == len(args.sizes_gib),
                "results": results,
            }
            write_json(args.json, doc)

    for gib in args.sizes_gib:
        nbytes = int(gib * GIB) // BLOCK_BYTES * BLOCK_BYTES
        say(f"{gib:g} GiB: allocating and touching, then registering with {args.threads} thread(s)")
        try:
            results.append(measure_size(nbytes, args.threads, cuda))
        except (RuntimeError, OSError, MemoryError) as exc:
            say(f"{gib:g} GiB failed: {exc}", "bold red")
            results.append({"gib": gib, "error": f"{type(exc).__name__}: {exc}"})
        write()
    rows = []
    for r in results:
        if "error" in r:
            rows.append([f"{r['gib']:g}", "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        for reg in r["registration"] or [{}]:
            rows.append(
                [
                    f"{r['gib']:g}",
                    f"{r['alloc_s']:.2f} s ({r['alloc_gibps']:.1f} GiB/s)",
                    reg.get("threads", "-"),
                    reg.get("chunks", "-"),
                    f"{reg['register_s']:.2f}" if reg else "n/a",
                    f"{reg['register_gibps']:.1f}" if reg else "n/a",
                    f"{reg['unregister_s']:.2f}" if reg else "n/a",
                ]
            )
    print_table(
        "HostCache set-up",
        ["GiB", "alloc + touch", "threads", "chunks", "register s", "register GiB/s", "unregister s"],
        rows,
    )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
