"""Which NUMA node host memory belongs on and how it is bound there (where its pages really are: :mod:`.placement`). On
a two-socket box a host cache on the far socket sends every offloaded byte over the inter-socket link as well as PCIe,
and the node that matters is the GPU's (:func:`choose_node`: its PCI device's ``numa_node`` in sysfs). Memory is bound
with the kernel's memory-policy system calls (:func:`bind_memory`, :func:`set_thread_policy`) through ctypes with the
machine's syscall numbers, no libnuma and no compiled code; threads that first-touch or register the memory run on the
node's CPUs (:func:`run_on_node`), and where the pages ended up is read back from ``/proc/self/numa_maps``, never
assumed. Stdlib only (torch is imported only to find a GPU's PCI address): the plugin's configuration parser imports it.
Every sysfs path is taken below a ``sysfs`` root (default ``/sys``) so tests can lay out a topology in a directory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SYSFS",
    "NodeChoice",
    "numa_setting",
    "parse_cpulist",
    "online_nodes",
    "nodes_with_memory",
    "node_cpus",
    "node_available_bytes",
    "pci_numa_node",
    "gpu_pci_bus_id",
    "choose_node",
    "check_node_memory",
    "mempolicy_supported",
    "bind_memory",
    "set_thread_policy",
    "thread_policy",
    "enter_node",
    "run_on_node",
]

logger = logging.getLogger(__name__)

SYSFS = "/sys"
NUMA_SETTINGS = "'auto' (the GPU's node), 'off', or a node number such as 0"

# uapi/linux/mempolicy.h
MPOL_DEFAULT = 0
MPOL_BIND = 2
# (mbind, set_mempolicy, get_mempolicy) system call numbers per machine (arch/*/syscall tables; the generic table
# for aarch64).
_SYSCALLS = {"x86_64": (237, 238, 239), "aarch64": (235, 237, 236), "ppc64le": (259, 261, 260)}
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


def numa_setting(value: Any, key: str = "numa_node") -> str | int:
    """A ``numa_node`` setting, checked: ``"auto"``, ``"off"`` or a node number (an int, or digits as a string).

    Raises:
        ValueError: anything else (bools and negative numbers too), naming ``key`` and the accepted forms.
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "off"):
            return text
        if text.isdigit():
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(f"{key} = {value!r} is not a NUMA setting; expected {NUMA_SETTINGS}")


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A sysfs list (``"0-3,8,10-11"``) as sorted numbers; empty for an empty list."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(out))


def read_file(path: str) -> str | None:
    """A file's text; None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _node_dir(sysfs: str, node: int | None = None) -> str:
    base = os.path.join(sysfs, "devices", "system", "node")
    return base if node is None else os.path.join(base, f"node{node}")


def online_nodes(sysfs: str = SYSFS) -> tuple[int, ...] | None:
    """The online nodes (``devices/system/node/online``); None where the kernel shows no NUMA topology."""
    text = read_file(os.path.join(_node_dir(sysfs), "online"))
    return None if text is None else parse_cpulist(text)


def nodes_with_memory(sysfs: str = SYSFS) -> tuple[int, ...] | None:
    """Nodes that have memory (``has_memory``; the online nodes where the file is missing)."""
    text = read_file(os.path.join(_node_dir(sysfs), "has_memory"))
    return online_nodes(sysfs) if text is None else parse_cpulist(text)


def node_cpus(node: int, sysfs: str = SYSFS) -> tuple[int, ...]:
    """The CPUs of ``node`` (``nodeN/cpulist``); empty for a node without CPUs or an unreadable list."""
    text = read_file(os.path.join(_node_dir(sysfs, node), "cpulist"))
    return () if text is None else parse_cpulist(text)


def node_available_bytes(node: int, sysfs: str = SYSFS) -> int | None:
    """Memory ``node`` can hand out now, free or reclaimable page cache: ``MemFree + Active(file) + Inactive(file) +
    SReclaimable`` of ``nodeN/meminfo`` (the kernel keeps no per-node ``MemAvailable``); None where unreadable."""
    text = read_file(os.path.join(_node_dir(sysfs, node), "meminfo"))
    if text is None:
        return None
    fields = {}
    for line in text.splitlines():
        # "Node 0 MemFree:         5048024 kB"
        parts = line.split()
        if len(parts) >= 4 and parts[2].endswith(":"):
            fields[parts[2][:-1]] = int(parts[3]) * 1024
    if "MemFree" not in fields:
        return None
    return sum(fields.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))


def pci_numa_node(bus_id: str, sysfs: str = SYSFS) -> int | None:
    """The node a PCI device (``"0000:1b:00.0"``) is attached to; None for ``-1`` (no affinity) or no such file."""
    text = read_file(os.path.join(sysfs, "bus", "pci", "devices", bus_id.lower(), "numa_node"))
    if text is None:
        return None
    node = int(text.strip())
    return None if node < 0 else node


def _normalized_bus_id(text: str) -> str:
    """``"00000000:1B:00.0"`` (the driver's form) -> ``"0000:1b:00.0"`` (sysfs's)."""
    domain, bus, rest = text.strip().split(":")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{rest.lower()}"


def gpu_pci_bus_id(index: int) -> str:
    """The PCI address of CUDA device ``index`` (as numbered in this process), in sysfs's form.

    From torch's device properties where they carry the PCI ids, else from the driver (``cuDeviceGetPCIBusId``).

    Raises:
        RuntimeError: neither answered (the message says why).
    """
    import torch

    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(i, int) for i in ids):
        return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    torch.cuda.init()  # the driver is initialised before it is asked
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(
            f"cannot find the PCI address of CUDA device {index}: libcuda.so.1 not loadable ({e})"
        ) from e
    device = ctypes.c_int()
    err = cuda.cuDeviceGet(ctypes.byref(device), ctypes.c_int(index))
    buf = ctypes.create_string_buffer(64)
    if err == 0:
        err = cuda.cuDeviceGetPCIBusId(buf, ctypes.c_int(len(buf)), device)
    if err != 0:
        raise RuntimeError(f"cannot find the PCI address of CUDA device {index}: cuDeviceGetPCIBusId returned {err}")
    return _normalized_bus_id(buf.value.decode())


@functools.cache
def _syscall_numbers() -> tuple[int, int, int] | None:
    return _SYSCALLS.get(platform.machine())


def mempolicy_supported() -> bool:
    """Whether this module knows the memory-policy system calls of this machine (Linux on x86-64, aarch64, ppc64le)."""
    return os.uname().sysname == "Linux" and _syscall_numbers() is not None


@dataclass(frozen=True)
class NodeChoice:
    """Where a buffer's memory goes.

    Attributes:
        setting: the ``numa_node`` setting, checked (``"auto"``, ``"off"`` or a node number).
        node: the node the memory is bound to; None: not bound (the kernel's default policy, first touch).
        cpus: the node's CPUs this process may run on, for the threads that touch and register the memory; empty
            when not bound, or when none of them is allowed to this process (the threads then run anywhere).
        why: one line: how the node was chosen, or why nothing is bound.
    """

    setting: str | int
    node: int | None
    cpus: tuple[int, ...] = ()
    why: str = ""

    @property
    def bound(self) -> bool:
        return self.node is not None


def choose_node(
    setting: Any,
    device: Any = None,
    *,
    sysfs: str = SYSFS,
    bus_id: Callable[[int], str] = gpu_pci_bus_id,
    key: str = "numa_node",
) -> NodeChoice:
    """The node for a buffer that ``device`` (a ``torch.device``, or None) transfers to and from.

    ``"auto"``: the node of the GPU's PCI device; not bound where there is no GPU (CPU tensors), where the device
    reports no node (``-1``, common in VMs), where the node has no memory, or where the kernel shows no NUMA topology
    or this machine's system calls are unknown here. A number: that node. ``"off"``: not bound.

    Args:
        bus_id: maps a CUDA device index to its PCI address (tests: a stand-in; default :func:`gpu_pci_bus_id`).

    Raises:
        ValueError: a bad setting, or a node number this machine does not have (or that has no memory), naming
            ``key`` and the nodes there are.
    """
    setting = numa_setting(setting, key)
    if setting == "off":
        return NodeChoice(setting, None, why=f"{key} = 'off': not bound (the kernel's default policy)")
    nodes = online_nodes(sysfs)
    with_memory = nodes_with_memory(sysfs) or ()
    if isinstance(setting, int):
        if nodes is None:
            raise ValueError(
                f"{key} = {setting}: this machine shows no NUMA nodes ({_node_dir(sysfs)}/online is missing); use "
                "'auto' or 'off'"
            )
        if setting not in nodes or setting not in with_memory:
            what = "has no memory" if setting in nodes else "does not exist"
            raise ValueError(
                f"{key} = {setting}: node {setting} {what} on this machine; nodes with memory: "
                f"{', '.join(map(str, with_memory)) or 'none'} (or use 'auto' or 'off')"
            )
        if not mempolicy_supported():
            raise ValueError(
                f"{key} = {setting}: binding memory needs Linux's memory-policy system calls, not known here for "
                f"{platform.machine()!r}; use 'off'"
            )
        return _bound(setting, setting, f"{key} = {setting}", sysfs)
    # auto
    if device is None or getattr(device, "type", None) != "cuda":
        return NodeChoice(setting, None, why=f"{key} = 'auto' without a GPU ({device or 'no device'}): not bound")
    index = device.index if device.index is not None else _current_cuda_device()
    try:
        bdf = bus_id(index)
    except (RuntimeError, OSError, ValueError) as e:
        return NodeChoice(setting, None, why=f"{key} = 'auto': GPU {index}'s PCI address is unknown ({e}): not bound")
    gpu = f"GPU {index} (PCI {bdf})"
    if nodes is None:
        return NodeChoice(setting, None, why=f"{key} = 'auto': {gpu}, but no NUMA topology in sysfs: not bound")
    node = pci_numa_node(bdf, sysfs)
    if node is None:
        return NodeChoice(setting, None, why=f"{key} = 'auto': {gpu} reports no NUMA node (numa_node -1): not bound")
    if node not in with_memory:
        return NodeChoice(setting, None, why=f"{key} = 'auto': {gpu} is on node {node}, which has no memory: not bound")
    if not mempolicy_supported():
        return NodeChoice(
            setting, None, why=f"{key} = 'auto': {gpu} is on node {node}; no memory-policy calls here: not bound"
        )
    return _bound(setting, node, f"{key} = 'auto': {gpu} is on node {node}", sysfs)


def _current_cuda_device() -> int:
    import torch

    return torch.cuda.current_device()


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its cpuset)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _bound(setting: str | int, node: int, why: str, sysfs: str) -> NodeChoice:
    allowed = _allowed_cpus()
    cpus = tuple(c for c in node_cpus(node, sysfs) if c in allowed)
    if not cpus:
        why += f" (no CPU of node {node} is allowed to this process: its threads run anywhere)"
    return NodeChoice(setting, node, cpus, why)


def check_node_memory(choice: NodeChoice, nbytes: int, what: str, *, sysfs: str = SYSFS, key: str = "numa_node"):
    """Refuses, before anything is allocated, more memory than the chosen node can hand out: bound memory does not
    spill to another node, and a node that runs out ends in the OOM killer (or SIGBUS for huge pages).

    Raises:
        ValueError: naming ``key``, the node, the bytes asked and the bytes it has.
    """
    if not choice.bound:
        return
    available = node_available_bytes(choice.node, sysfs)
    if available is not None and nbytes > available:
        raise ValueError(
            f"{key} = {choice.setting!r} binds {what} ({nbytes} bytes, {nbytes / 2**30:.2f} GiB) to node "
            f"{choice.node}, which has {available} bytes ({available / 2**30:.2f} GiB) free or reclaimable "
            f"({_node_dir(sysfs, choice.node)}/meminfo): free memory there, use another node, or 'off'"
        )


def _nodemask(node: int) -> tuple[ctypes.Array, int]:
    words = node // _ULONG_BITS + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // _ULONG_BITS] = 1 << (node % _ULONG_BITS)
    # maxnode: the kernel reads maxnode - 1 bits (as libnuma passes it).
    return mask, words * _ULONG_BITS + 1


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(index: int, name: str, *args) -> None:
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(f"{name}: no system call number known for {platform.machine()!r}")
    syscall = _libc().syscall
    syscall.restype = ctypes.c_long
    if syscall(ctypes.c_long(numbers[index]), *args) == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{name} failed: {os.strerror(err)}")


def bind_memory(address: int, nbytes: int, node: int) -> None:
    """``mbind(MPOL_BIND)``: pages of ``[address, address + nbytes)`` faulted from now on come from ``node`` only.

    Call before the first touch; pages already present stay where they are.

    Raises:
        OSError: the kernel refused (e.g. ``EINVAL`` for a node it does not have or this process may not use).
    """
    mask, maxnode = _nodemask(node)
    _syscall(
        0,
        f"mbind(MPOL_BIND, node {node}) of {nbytes} bytes at {address:#x}",
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_long(MPOL_BIND),
        mask,
        ctypes.c_ulong(maxnode),
        ctypes.c_uint(0),
    )


def set_thread_policy(node: int | None) -> None:
    """``set_mempolicy`` of the calling thread: ``MPOL_BIND`` to ``node``, or back to the default for None.

    For memory this code does not map itself (vLLM's shared region, the driver's pinned allocation): whatever the
    thread faults in meanwhile comes from ``node``.
    """
    if node is None:
        _syscall(1, "set_mempolicy(MPOL_DEFAULT)", ctypes.c_long(MPOL_DEFAULT), None, ctypes.c_ulong(0))
        return
    mask, maxnode = _nodemask(node)
    _syscall(1, f"set_mempolicy(MPOL_BIND, node {node})", ctypes.c_long(MPOL_BIND), mask, ctypes.c_ulong(maxnode))


def thread_policy() -> tuple[int, tuple[int, ...]]:
    """``get_mempolicy`` of the calling thread: its mode (``MPOL_DEFAULT`` 0, ``MPOL_BIND`` 2, ...) and nodes."""
    mode = ctypes.c_int()
    mask = (ctypes.c_ulong * 16)()
    _syscall(2, "get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(16 * _ULONG_BITS), None, ctypes.c_ulong(0))
    nodes = tuple(i for i in range(16 * _ULONG_BITS) if mask[i // _ULONG_BITS] >> (i % _ULONG_BITS) & 1)
    return mode.value, nodes


def enter_node(choice: NodeChoice, *, bind_thread: bool = False) -> None:
    """Moves the calling thread onto ``choice``'s CPUs and, with ``bind_thread``, binds its memory policy to the
    node. For threads of their own (a pool's initializer, :func:`run_on_node`): nothing here is undone."""
    if choice.cpus:
        os.sched_setaffinity(0, choice.cpus)  # 0: the calling thread only
    if bind_thread and choice.bound:
        set_thread_policy(choice.node)


def run_on_node(choice: NodeChoice, fn: Callable[[], Any], *, bind_thread: bool = False, name: str = "numa") -> Any:
    """``fn()`` in a new thread on ``choice``'s CPUs (and under its memory policy with ``bind_thread``), so that the
    caller's own affinity and policy never change; returns its result or raises its exception. Not bound and no
    CPUs: ``fn()`` runs here."""
    if not choice.cpus and not (bind_thread and choice.bound):
        return fn()
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            enter_node(choice, bind_thread=bind_thread)
            out["result"] = fn()
        except BaseException as e:  # re-raised in the caller
            out["error"] = e

    thread = threading.Thread(target=target, name=f"triton-offload-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("result")


def cpus_text(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
