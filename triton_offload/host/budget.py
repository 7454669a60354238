"""The host cache's size: a rank's share of the instance's byte budget in whole host blocks, and the refusal, before
anything is allocated, of more host memory than this machine has available.
"""

from __future__ import annotations

import logging

from triton_offload._checks import positive_int

__all__ = ["host_blocks_for_budget", "available_host_bytes", "check_host_memory"]

logger = logging.getLogger(__name__)


def host_blocks_for_budget(cpu_bytes_to_use: int, host_block_bytes: int, world_size: int = 1) -> int:
    """Host blocks one rank gets: its share of the instance-wide budget divided by the bytes of a host block.

    Raises:
        ValueError: a non-positive size, or a share too small for one block (both sizes named).
    """
    for name, value in (
        ("cpu_bytes_to_use", cpu_bytes_to_use),
        ("host_block_bytes", host_block_bytes),
        ("world_size", world_size),
    ):
        positive_int(value, name)
    share = cpu_bytes_to_use // world_size
    if share < host_block_bytes:
        raise ValueError(
            f"cpu_bytes_to_use = {cpu_bytes_to_use} bytes gives each of {world_size} rank(s) {share} bytes, "
            f"less than one host block of {host_block_bytes} bytes"
        )
    return share // host_block_bytes


def available_host_bytes() -> int | None:
    """Host memory that can be allocated now without swapping: ``MemAvailable`` of ``/proc/meminfo`` (Linux), in
    bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(nbytes: int, setting: str) -> None:
    """Refuses, before anything is allocated, host memory this machine does not have available.

    A buffer larger than RAM otherwise fails in ``mmap`` with a bare ``ENOMEM``; one below RAM but above what is
    available is mapped and then ends in the OOM killer while its pages are touched.

    Args:
        nbytes: the bytes about to be allocated in this process.
        setting: the configured value that asks for them, for the message (e.g. ``"cpu_bytes_to_use = 40GiB ..."``).

    Raises:
        ValueError: ``nbytes`` exceeds :func:`available_host_bytes`; the message names ``setting``, the bytes asked
            and the bytes available. Where the available memory cannot be read, nothing is checked.
    """
    available = available_host_bytes()
    if available is None:
        logger.debug("MemAvailable not readable: not checking %d bytes of host memory for %s", nbytes, setting)
        return
    if nbytes > available:
        raise ValueError(
            f"{setting} asks for {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host memory on this machine, but only "
            f"{available} bytes ({available / 2**30:.2f} GiB) are available (MemAvailable in /proc/meminfo): lower "
            "it, or free host memory"
        )
