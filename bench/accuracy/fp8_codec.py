"""The FP8 host format's numerics as vectorised PyTorch, for the accuracy harness on CPU (``--fp8-codec torch``).
On CPU the FP8 kernel (``kernels/fp8_blocks.py``) runs under Triton's interpreter, one work item (one head of one
block) at a time: a 200-prompt run of the harness did not finish in 31 minutes. Accuracy depends only on the bytes
the format stores and restores, so :class:`TorchFp8Launcher` computes the same bytes with whole-tensor operations: per
run of the spec, every block of the transfer at once (scale: the smallest power of two with amax / scale <= 448, amax
over finite values; values by torch's round-to-nearest-even E4M3 conversion; NaN and Inf stored as 0x7F; restored as
code x scale clamped to the cache dtype's finite range). It reads the spec's geometry (segments and runs), not the
kernel's table. It is no part of the library: the harness installs it in its engine's process only when asked, and
the first :data:`CROSS_CHECKS` launches each way also run the kernel and must leave identical bytes (else the run
fails); the report says which codec ran and how many launches were cross-checked.
"""

from __future__ import annotations

import torch

from triton_offload.issuers.fp8_launcher import Fp8Launcher
from triton_offload.plan import Direction, TransferPlan

__all__ = ["TorchFp8Launcher", "install", "CROSS_CHECKS", "cross_checked"]

CROSS_CHECKS = 8  # launches per direction that also run the kernel, compared byte for byte
NAN_CODE = 0x7F
_QUIET_NAN = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}  # bits
_checked = {Direction.STORE: 0, Direction.LOAD: 0}


def cross_checked() -> dict[str, int]:
    """Launches per direction whose bytes were compared with the kernel's in this process."""
    return {d.value: n for d, n in _checked.items()}


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of ``t``'s dtype over its whole storage (segments address bytes from the storage's start)."""
    return t.new_empty(0).set_(t.untyped_storage())


def _exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per head, the scale's exponent: the smallest e with ``amax <= 448 * 2**e``, at least -126; 0 for amax 0."""
    bits = amax.view(torch.int32)
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return torch.where(amax == 0, 0, torch.clamp(e, min=-126))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 scales) of ``x`` (n, tokens, heads, dim) bf16 / fp16: one scale per (n, head)."""
    x = x.float()
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), 0).amax(dim=(1, 3))
    e = _exponents(amax)
    inv = ((127 - e) << 23).view(torch.float32)  # 2**-e: exact scaling
    y = torch.where(finite, x * inv[:, None, :, None], 0)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(finite, codes, NAN_CODE).to(torch.uint8), ((e + 127) << 23).view(torch.float32)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache dtype's values of ``codes`` (n, tokens, heads, dim) and ``scales`` (n, heads); NaN codes restore
    as the positive quiet NaN the kernel writes on CPU (torch's own conversion gives another payload)."""
    v = codes.view(torch.float8_e4m3fn).float() * scales[:, None, :, None]
    limit = torch.finfo(dtype).max
    out = v.clamp(-limit, limit).to(dtype).view(torch.int16)
    return torch.where(v.isnan(), _QUIET_NAN[dtype], out).view(dtype)


class TorchFp8Launcher(Fp8Launcher):
    """An :class:`Fp8Launcher` whose CPU launches compute the format's bytes with whole-tensor PyTorch (CUDA ones go
    to the kernel unchanged)."""

    def launch(self, plan: TransferPlan, ids: torch.Tensor, num_ctas: int | None = None, res=None, copy=True) -> None:
        if self.cuda:
            return super().launch(plan, ids, num_ctas, res, copy)
        if _checked[plan.direction] < CROSS_CHECKS:
            self._cross_check(plan, ids, num_ctas)
        else:
            self._move(plan)

    def _move(self, plan: TransferPlan) -> None:
        store = plan.direction is Direction.STORE
        f = self.blocks_per_host_block
        flat_host = torch.as_strided(self.host, (self.host.numel(),), (1,))
        row = self.host_row
        for segs, (gpu_ids, host_ids, skip) in zip(self.spec.group_segments, plan.groups()):
            if len(gpu_ids) == 0:
                continue
            pos = skip + torch.arange(len(gpu_ids))
            host = torch.as_tensor(host_ids)[pos // f]
            g = torch.as_tensor(gpu_ids)
            for s in segs:
                r = self.spec.quant[s.layer]
                kv = self.spec.kv_caches[s.layer]
                esize = kv.element_size()
                flat = _storage_view(kv)
                start = (s.base - flat.data_ptr()) // esize
                n_all = int(g.max()) + 1
                gpu = flat.as_strided(
                    (n_all, r.tokens, r.heads, r.head_dim),
                    (s.block_stride // esize, r.token_stride, r.head_stride, 1),
                    start,
                )
                base = host * row + (pos % f) * s.host_stride + f * s.host_region + s.host_offset
                t = torch.arange(r.tokens)[:, None, None] * r.token_stride
                el = t + torch.arange(r.heads)[None, :, None] * r.head_stride + torch.arange(r.head_dim)
                at = base[:, None, None, None] + el
                scale_at = base[:, None, None] + r.value_bytes + 4 * torch.arange(r.heads)[:, None] + torch.arange(4)
                if store:
                    codes, scales = quantize(gpu[g])
                    flat_host[at] = codes
                    flat_host[scale_at] = scales.contiguous().view(torch.uint8).view(len(g), r.heads, 4)
                else:
                    scales = flat_host[scale_at].contiguous().view(torch.float32).view(len(g), r.heads)
                    gpu[g] = dequantize(flat_host[at], scales, kv.dtype)

    def _cross_check(self, plan: TransferPlan, ids: torch.Tensor, num_ctas: int | None) -> None:
        """The kernel's launch, then this codec's over the same targets: both must leave the same bytes."""
        store = plan.direction is Direction.STORE
        targets = self._targets(plan, store)
        super().launch(plan, ids, num_ctas)
        by_kernel = [t.clone() for t in targets()]
        self._move(plan)
        for i, (a, b) in enumerate(zip(by_kernel, targets())):
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                raise RuntimeError(f"the torch FP8 codec and the kernel wrote different bytes ({plan.direction}, {i})")
        _checked[plan.direction] += 1

    def _targets(self, plan: TransferPlan, store: bool):
        """What a launch may write, as a function returning its bytes now: the rows of its host ids (a store) or
        every layer's whole cache (a load)."""
        if store:
            rows = torch.as_tensor(plan.host_ids)
            return lambda: [self.host[rows]]
        return lambda: list(self.spec.kv_caches)


def install() -> None:
    """Makes the issuers' factory build :class:`TorchFp8Launcher` (in this process)."""
    from triton_offload.issuers import factory

    factory.Fp8Launcher = TorchFp8Launcher
