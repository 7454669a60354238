"""Test-only vLLM offloading specs whose workers corrupt host bytes on command (docs/integrity.md's end-to-end tests).

vLLM loads them in each of its processes through ``kv_connector_extra_config``'s ``"spec_name": "CorruptingSpec"``
(``"CorruptingTieringSpec"`` for the tiering spec) and ``"spec_module_path": "integrity_plugin"``, with tests/e2e/ on
``PYTHONPATH``. Nothing in the engine or in our worker is edited: the specs' documented hook (``_worker_class``) names
a subclass whose only addition is this: before submitting a load, if the file named by ``TRITON_OFFLOAD_CORRUPT``
exists, it reads an order from it (JSON: ``{"block": i, "byte": b, "bit": k}``), deletes it, and flips bit k of byte
b of the host block the load's i-th host id names, as a bad DIMM, a stray write or a kernel bug would, then records
what it did (``TRITON_OFFLOAD_CORRUPT_RECORD``, one JSON line). ``"spec_name": "PerturbingSpec"`` is the accuracy
harness's lossy stand-in (bench/accuracy): its worker flips one byte of every host block once, before the block's first
load after its store (``TRITON_OFFLOAD_PERTURB``: ``"offset:mask"``, the byte and what it is XORed with).
"""

from __future__ import annotations

import json
import os

from triton_offload.connector.spec import TritonOffloadingSpec
from triton_offload.connector.tiering import TritonTieringOffloadingSpec
from triton_offload.connector.tiering_worker import TritonTieringWorker
from triton_offload.connector.worker import TritonOffloadingWorker


def corrupt_host(worker, host_spec) -> None:
    """Carries out a pending corruption order on the host block a load is about to read."""
    path = os.environ.get("TRITON_OFFLOAD_CORRUPT")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        order = json.load(f)
    os.remove(path)
    host_id = int(worker._host_ids(host_spec)[order.get("block", 0)])
    buffer = worker.engine.host_buffer
    byte = order.get("byte", 0) % buffer.shape[1]
    buffer[host_id, byte] ^= 1 << order.get("bit", 0)
    record = os.environ.get("TRITON_OFFLOAD_CORRUPT_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"host_block": host_id, "byte": byte, "bit": order.get("bit", 0)}) + "\n")


class CorruptsLoads:
    """Put before either of our workers: carries out a pending order (:func:`corrupt_host`) before it submits a
    load."""

    def _submit(self, job_id, gpu, host, store, **kwargs):  # kwargs: the worker's own (expedited)
        if not store:
            corrupt_host(self, host)
        return super()._submit(job_id, gpu, host, store, **kwargs)


class PerturbsLoads:
    """Put before our worker: XORs one byte of each host block a load reads, once per stored content."""

    def _submit(self, job_id, gpu, host, store, **kwargs):
        ids = [int(i) for i in self._host_ids(host)]
        done = self.__dict__.setdefault("_perturbed", set())
        if store:
            done.difference_update(ids)  # new content: to be perturbed at its first load
        else:
            offset, mask = (int(x, 0) for x in os.environ.get("TRITON_OFFLOAD_PERTURB", "3:0x08").split(":"))
            buffer = self.engine.host_buffer
            for host_id in set(ids) - done:
                buffer[host_id, offset % buffer.shape[1]] ^= mask
                done.add(host_id)
        return super()._submit(job_id, gpu, host, store, **kwargs)


class PerturbingWorker(PerturbsLoads, TritonOffloadingWorker):
    pass


class PerturbingSpec(TritonOffloadingSpec):
    @staticmethod
    def _worker_class():
        return PerturbingWorker


class CorruptingWorker(CorruptsLoads, TritonOffloadingWorker):
    pass


class CorruptingSpec(TritonOffloadingSpec):
    @staticmethod
    def _worker_class():
        return CorruptingWorker


class CorruptingTieringWorker(CorruptsLoads, TritonTieringWorker):
    pass


class CorruptingTieringSpec(TritonTieringOffloadingSpec):
    @staticmethod
    def _worker_class():
        return CorruptingTieringWorker
