"""The machine the methods run on: :class:`Env` (the device and the CUDA driver), how a GPU measurement starts
(:func:`open_gpu`), what a results file records about it (:func:`environment`, :func:`driver_info`,
:func:`print_header`), and releasing memory between groups."""

from __future__ import annotations

import ctypes
import gc
import platform
import shutil
import subprocess
import weakref
from dataclasses import dataclass, field

import torch
import triton

import triton_offload as to
from bench.common.report import say
from bench.common.results import machine_info
from triton_offload.cuda_driver import CudaDriver, CudaError
from triton_offload.kernels.shapes import DEFAULT_NUM_CTAS

__all__ = [
    "Env",
    "FatalCudaError",
    "cuda_version_text",
    "load_driver",
    "driver_info",
    "environment",
    "open_gpu",
    "print_header",
    "release",
]


@dataclass
class Env:
    """What the methods may use on this machine.

    Attributes:
        device: where the caches live.
        driver: the CUDA driver through ctypes, None without CUDA (or when libcuda cannot be used).
        driver_note: which driver, or why not.
        stream_handle: raw handle of the benchmark's (non-default) CUDA stream; 0 on CPU.
        held: what methods keep between the cases of one run, per spec (held weakly, so it goes with the workload's
            caches; a value must not reference the spec): auto's calibrations, vLLM's worker.
        calibrations: what each of auto's calibrations in this run measured and took, for the results file.
    """

    device: torch.device
    driver: CudaDriver | None
    driver_note: str
    stream_handle: int = 0
    held: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    calibrations: list[dict] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def alive(self) -> bool:
        """Whether the CUDA context still works after an error (a sticky error such as an illegal address kills it,
        and nothing after it can be measured). Always True on CPU."""
        if not self.cuda:
            return True
        try:
            torch.cuda.synchronize(self.device)
            return True
        except RuntimeError:
            return False


class FatalCudaError(RuntimeError):
    """The CUDA context is unusable (a sticky error such as an illegal address): nothing after it can be measured."""


def cuda_version_text(version: int) -> str:
    """A driver's CUDA version as cuDriverGetVersion encodes it (1000 * major + 10 * minor) -> ``"major.minor"``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def load_driver(device_index: int) -> tuple[CudaDriver | None, str]:
    """(the library's ctypes driver, a description) or (None, why not)."""
    try:
        driver = CudaDriver(device_index)
    except CudaError as exc:
        return None, str(exc)
    return driver, f"driver API via ctypes on libcuda.so.1, CUDA {cuda_version_text(driver.version)}"


def driver_info() -> dict:
    """The kernel driver version (nvidia-smi) and the CUDA version the driver supports, where they can be read."""
    info: dict = {"driver": None, "driver_cuda": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.strip()
            info["driver"] = out.splitlines()[0] if out else None
        except (subprocess.SubprocessError, OSError):
            pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            info["driver_cuda"] = cuda_version_text(version.value)
    except OSError:
        pass
    return info


def release(device: torch.device) -> None:
    """Frees what the last group held, device and pinned host memory both, before the next is allocated."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # PyTorch caches pinned blocks too; names differ across versions.
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
            torch._C, "_host_emptyCache", None
        )
        if empty_host is not None:
            empty_host()


def environment(device: torch.device, driver_note: str) -> dict:
    """The machine and versions a results file records."""
    info = {
        **machine_info(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "triton_offload": to.__version__,
        "cuda_driver_api": driver_note,
        "default_num_ctas": DEFAULT_NUM_CTAS,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=torch.cuda.get_device_name(device), sms=props.multi_processor_count, **driver_info())
    else:
        info.update(device=f"cpu ({platform.machine()})", sms=None, driver=None, driver_cuda=None)
    return info


def open_gpu() -> tuple[torch.device, torch.cuda.Stream, Env, dict]:
    """What every GPU measurement starts from: the current device (its primary context created), the benchmark's
    own stream, the methods' :class:`Env` and the run's :func:`environment`."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # creates the primary context on this thread before the driver API looks for it
    stream = torch.cuda.Stream(device)  # not the legacy default stream: cuMemcpyBatchAsync rejects that one
    driver, driver_note = load_driver(device.index)
    return device, stream, Env(device, driver, driver_note, stream.cuda_stream), environment(device, driver_note)


def print_header(meta: dict, mode: str, benchmark: str = "transfer") -> None:
    say(f"triton-offload {benchmark} benchmark -- {mode}", style="bold")
    say(
        f"device {meta['device']}" + (f" ({meta['sms']} SMs)" if meta["sms"] else "")
        + f" | driver {meta['driver']} (CUDA {meta['driver_cuda']}) | CUDA (torch) {meta['cuda']}"
        + f" | torch {meta['torch']} | Triton {meta['triton']} | Python {meta['python']}"
    )  # fmt: skip
    say(f"copy baselines: {meta['cuda_driver_api']} | default num_ctas = {DEFAULT_NUM_CTAS} | {meta['timestamp']}")
