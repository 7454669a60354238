"""The FP8 benchmark's kernel with the integrity checks (bench/micro/fp8.py's ``fp8+checks`` rows): a store or load of
a :class:`~bench.micro.fp8_cases.Group` issued as ``bench.baselines.ours``' ``triton_integrity`` issues the copy
kernel's (a plan naming each host row by its id, the ids in a staged slot, one launch that moves, quantizes and
checksums, each program writing its blocks' checksums or checking them, the slot given back behind an event),
so the rows differ from plain FP8 by the checks alone. ``"verify"``: a load of rows this group stored finds their
checksums; on CPU the outcome is read at once and a flagged block raises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.micro.fp8_cases import Group
from triton_offload import integrity
from triton_offload.checksums import Checksums
from triton_offload.issuers import IssuerContext
from triton_offload.issuers.factory import build_kernel, kernel_launcher
from triton_offload.plan import Direction, TransferPlanner
from triton_offload.staging import IdStager

__all__ = ["checked_runners", "check_checked"]


def checked_runners(
    group: Group, host_format: str | None, num_ctas: int | None = None, strict: bool = False
) -> dict[str, Callable]:
    """``{"store": run, "load": run}`` for ``host_format``'s spec and host rows, with one checksum table between them
    (a load checks what the store wrote). ``strict``: each call waits for its launch (on CUDA) and raises if the
    checks flagged a block (on CPU always)."""
    spec, host = group.specs[host_format], group.hosts[host_format]
    cuda = host.device.type == "cuda" or group.caches[0].device.type == "cuda"
    checks = Checksums.allocate(integrity.VERIFY, host.shape[0], 1, pin=cuda, regions=spec.num_regions)
    planner = TransferPlanner(spec, host.shape[0], 1)
    stager = IdStager(group.caches[0].device) if cuda else None
    runners = {}
    for direction, gpu_ids in ((Direction.STORE, group.g_src), (Direction.LOAD, group.g_dst)):
        kernel = kernel_launcher(spec, host, 1, direction=direction, checksums=checks, num_ctas=num_ctas)
        issuer = build_kernel(IssuerContext(spec, host, 1, kernel.launcher, stager, kernel.num_ctas))

        def run(issuer=issuer, direction=direction, gpu_ids=gpu_ids) -> None:
            plan = planner.plan(gpu_ids, group.host_ids, direction=direction, identities=group.host_ids)
            keep = issuer.issue(plan)
            if cuda and strict:
                torch.cuda.current_stream().synchronize()
            if cuda and not strict:  # the slot is reused once the launch has read the ids and written its results
                after = torch.cuda.Event()
                after.record()
                issuer.release(keep, after)
                return
            outcome = issuer.outcome(keep)
            issuer.release(keep)
            if outcome is not None and outcome.failed.size:
                raise RuntimeError(f"the integrity checks flagged intact blocks at {outcome.failed.tolist()}")

        runners[direction.value] = run
    return runners


def check_checked(group: Group, host_format: str) -> list[str]:
    """What is wrong with the checked kernel (nothing: []): after :func:`~bench.micro.fp8_cases.check_group` left the
    unchecked kernel's rows and loaded blocks in place, the checked store must write the same host rows, and the
    checked load, which must flag nothing, the same blocks."""
    from bench.micro.fp8_cases import _blocks, _poison_destinations, _sync, load

    runners = checked_runners(group, host_format, strict=True)
    host, rows = group.hosts[host_format], torch.as_tensor(group.host_ids)
    stored = host[rows].clone()
    loaded = [_blocks(c, group.layout, group.g_dst).clone() for c in group.caches]
    problems = []
    try:
        runners["store"]()
        _sync(group)
        if not torch.equal(host[rows], stored):
            problems.append(f"{host_format}+checks: the checked store wrote other host bytes than the plain one")
        _poison_destinations(group)
        runners["load"]()
        _sync(group)
    except RuntimeError as e:
        return [*problems, f"{host_format}+checks: {e}"]
    for layer, (c, want) in enumerate(zip(group.caches, loaded)):
        if not torch.equal(_blocks(c, group.layout, group.g_dst).view(torch.int16), want.view(torch.int16)):
            problems.append(f"{host_format}+checks: layer {layer}'s checked load differs from the plain one")
            break
    load(group, host_format)  # the plain kernel's state again, for whatever runs next
    return problems
