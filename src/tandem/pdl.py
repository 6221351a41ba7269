"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and newer.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
finishing, so the gap between two kernels shrinks; each of its programs first waits
(`wait`, under the kernel's PDL flag) until that kernel has completed and its writes are
visible, and only then reads or writes memory. Every Triton kernel here waits as its first
statement but one: the decode kernel after the shared-prefix kernel, which lets it start at
once (`launch_dependents`), reads only the keys and queries written before that kernel, and
waits before it merges that kernel's partials (attention/triton_kernels.py). TANDEM_PDL=0
launches them plainly, for comparisons.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tandem import envs

ENABLED = envs.pdl()


@triton.jit
def wait(PDL: tl.constexpr):
    """A kernel's first statement (PDL from `launch_args`): the kernel before it has finished
    writing."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """The next kernel's programs may start now, beside this kernel's (each still waits for
    this kernel's writes before it reads them)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: the kernel's PDL flag, and Triton's
    `launch_pdl` where the device has PDL (the interpreter gets neither)."""
    if not ENABLED or device.type != "cuda":
        return {"PDL": False}
    index = torch.cuda.current_device() if device.index is None else device.index
    return {"PDL": True, "launch_pdl": True} if _supported(index) else {"PDL": False}
