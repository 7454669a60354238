"""Test-only vLLM offloading spec: TritonOffloadingSpec with one injected transfer failure, recording what happens.

vLLM loads it in each of its processes through ``kv_connector_extra_config={"spec_name": "FaultInjectingSpec",
"spec_module_path": "offload_fault_plugin", ...}`` (with tests/e2e/ on ``PYTHONPATH``). Nothing in the engine is
edited: the worker's documented test hook (``TritonOffloadingWorker.engine_class``) names :class:`FailingEngine`,
which reports the chosen job as failed, as the engine reports a launch or CUDA error. Environment:

* ``TRITON_OFFLOAD_FAULT``: ``"store:N"`` or ``"load:N"``, the N-th job of that direction fails (1-based); unset:
  none fails.
* ``TRITON_OFFLOAD_FAULT_RECORD``: a file receiving one JSON object per line, from every process: each store prepared
  by the scheduler (keys, host ids, or ``null`` with whether the manager's state stayed the same), each store
  completed, each load prepared and completed, each job submitted to the worker, the injected failure, each batch
  of results the worker reported and the error it raised.
"""

from __future__ import annotations

import dataclasses
import json
import os

from triton_offload.connector.manager import TritonOffloadingManager
from triton_offload.connector.spec import TritonOffloadingSpec
from triton_offload.connector.worker import TritonOffloadingWorker
from triton_offload.engine import LOAD, STORE, TransferEngine


def record(kind: str, **fields) -> None:
    with open(os.environ["TRITON_OFFLOAD_FAULT_RECORD"], "a") as f:
        f.write(json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\n")


def _fault() -> tuple[str, int] | None:
    spec = os.environ.get("TRITON_OFFLOAD_FAULT")
    if not spec:
        return None
    direction, n = spec.split(":")
    return direction, int(n)


class FailingEngine(TransferEngine):
    """The transfer engine, reporting the chosen job as failed (as it reports a launch or CUDA error), whatever the
    copy did. Only public methods are overridden, so the engine's own code runs unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fault = _fault()
        self._seen = {STORE: 0, LOAD: 0}
        self._doomed: int | None = None

    def _count(self, job_id: int, direction: str) -> None:
        self._seen[direction] += 1
        if self._fault == (direction, self._seen[direction]):
            self._doomed = job_id

    def submit_store(self, job_id, *args, **kwargs):
        self._count(job_id, STORE)
        super().submit_store(job_id, *args, **kwargs)

    def submit_load(self, job_id, *args, **kwargs):
        self._count(job_id, LOAD)
        super().submit_load(job_id, *args, **kwargs)

    def get_finished(self):
        results = super().get_finished()
        for i, r in enumerate(results):
            if r.job_id == self._doomed:
                record("injected", job_id=r.job_id, direction=r.direction)
                error = f"RuntimeError('injected fault in {r.direction} job {r.job_id}')"
                results[i] = dataclasses.replace(r, ok=False, error=error)
        return results


class FaultWorker(TritonOffloadingWorker):
    engine_class = FailingEngine

    def _submit(self, job_id, gpu, host, store, **kwargs):
        record("submit", job_id=job_id, direction="store" if store else "load", host_ids=self._host_ids(host).tolist())
        return super()._submit(job_id, gpu, host, store, **kwargs)

    def get_finished(self):
        try:
            results = super().get_finished()
        except Exception as e:
            record("worker_raised", error=str(e))
            raise
        if results:
            record("worker_reported", jobs=[[r.job_id, r.success] for r in results])
        return results


class RecordingManager(TritonOffloadingManager):
    def prepare_store(self, keys, req_context):
        before = self._manager.snapshot()
        out = super().prepare_store(keys, req_context)
        if out is None:
            unchanged = before == self._manager.snapshot()
            record("prepare_store", keys=[k.hex() for k in keys], host_ids=None, unchanged=unchanged)
        else:
            keys = [k.hex() for k in out.keys_to_store]
            record("prepare_store", keys=keys, host_ids=out.store_spec.block_ids.tolist())
        return out

    def complete_store(self, keys, req_context, success=True):
        record("complete_store", keys=[k.hex() for k in keys], success=success)
        super().complete_store(keys, req_context, success)

    def prepare_load(self, keys, req_context):
        spec = super().prepare_load(keys, req_context)
        record("prepare_load", keys=[k.hex() for k in keys], host_ids=spec.block_ids.tolist())
        return spec

    def complete_load(self, keys, req_context):
        record("complete_load", keys=[k.hex() for k in keys])
        super().complete_load(keys, req_context)


class FaultInjectingSpec(TritonOffloadingSpec):
    def get_manager(self):
        if self._manager is None:
            cfg = self.offload_config
            self._manager = RecordingManager(self.num_host_blocks, cfg.eviction_policy)
        return self._manager

    @staticmethod
    def _worker_class():
        return FaultWorker
