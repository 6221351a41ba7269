"""The TANDEM_* environment switches: every one is read and validated here, and only here.

They exist for before/after comparisons on a GPU; the defaults are the fast paths.
docs/environment.md lists them (a test keeps that table and SWITCHES the same). A value a
switch does not take is a ValueError naming the variable, raised where the switch is read:
at import for the module-level ones, so a run fails before it loads a model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    values: str  # what it takes, as the docs table says it
    effect: str  # what a non-default value does


SWITCHES = {
    s.name: s
    for s in (
        Switch("TANDEM_FUSED_KERNELS", "1", "0, 1",
               "0: the torch versions of the fused Triton kernels (add + RMSNorm, SiLU * up, "
               "q/k norm + rotary + K/V store, the sampler)"),
        Switch("TANDEM_PDL", "1", "0, 1",
               "0: Triton kernels launch plainly, without programmatic dependent launch (Hopper)"),
        Switch("TANDEM_FP8_V_BITS", "1", "0, 1",
               "0: the attention kernels widen the V tiles of an FP8 KV cache to float16 by the "
               "cvt instruction, not by integer bit operations"),
        Switch("TANDEM_SPLIT_MERGE", "1", "0, 1",
               "0: decode batches of 2-4 splits merge their partials in a reduce launch, not in "
               "the last split of each sequence's KV head to finish"),
        Switch("TANDEM_FUSED_ROPE", "1", "0, 1",
               "0: decode-only steps norm and rotate q and k and store the new K/V in a launch of "
               "their own, not in the decode attention kernel"),
        Switch("TANDEM_SPLITK", "1", "0, 1",
               "0: the decode steps' o and down projections through cuBLAS, not the split-K "
               "Triton kernel"),
        Switch("TANDEM_BLAS_SLICES", "", "0, 1, 2, 4 or 8",
               "the o and down projections of decode steps past 64 rows that split-K's Triton "
               "kernel declines: 0, cuBLAS's own product; 1-8, cuBLAS's batched product over "
               "that many slices of the input features in every case"),
        Switch("TANDEM_FP8_FUSED_QUANT", "1", "0, 1",
               "0: FP8 (W8A8) layers quantize their input in a launch of their own, not in the "
               "add + RMSNorm or SiLU * up kernel before them"),
        Switch("TANDEM_PIECEWISE", "1", "0, 1",
               "0: steps with prefill run eagerly, not as CUDA graphs of the pieces between "
               "their attentions"),
        Switch("TANDEM_BLAS", "cublas", "cublas, cublaslt",
               "cublaslt: the captured decode graphs' matmuls through cuBLASLt"),
        Switch("TANDEM_DECODE_TILES", "", "block_n,num_warps,num_stages",
               "one attention tile shape for every decode batch of more than one sequence "
               "(block_n a power of two >= 16, num_warps 1-16 a power of two, num_stages >= 1)"),
        Switch("TANDEM_DECODE_SPLITS", "", "1, 2, 4, 8, 16 or 32",
               "one split count of each context for every decode batch of more than one "
               "sequence"),
        Switch("TANDEM_SHARED_PREFIX_TILES", "", "block_n,num_warps,num_stages",
               "the tile shape of the shared-prefix (cascade) attention kernel, as "
               "TANDEM_DECODE_TILES takes it"),
        Switch("TANDEM_DECODE_MAXNREG", "", "an integer 32-255",
               "the most registers a thread of the decode attention kernel may use (ptxas' cap, "
               "Triton's maxnreg; CUDA only)"),
        Switch("TANDEM_GLUON_DECODE", "fp8", "fp8, all, none",
               "which decode batches of 128 rows or more take the Gluon decode kernel "
               "(attention/gluon_decode.py) rather than the Triton one: those over an FP8 KV "
               "cache, those over a 16-bit cache too, or none"),
        Switch("TANDEM_FP8_DECODE_STAGES", "4", "an integer 2-8",
               "tiles of keys in shared memory a program of the Gluon FP8 decode kernel"),
        Switch("TANDEM_FP8_DECODE_ROW_LANES", "8", "2, 4 or 8",
               "threads that copy one key's 128-byte row of K or V in the Gluon FP8 decode "
               "kernel, 16 bytes each an instruction"),
        Switch("TANDEM_MOE_TILES", "", "block_n,block_k,num_warps,num_stages",
               "one tile shape for the fused MoE kernel's grouped GEMMs (block_n and block_k "
               "powers of two >= 16)"),
    )
}  # fmt: skip


def _value(name: str) -> str:
    return os.environ.get(name, SWITCHES[name].default).strip()


def _flag(name: str) -> bool:
    value = _value(name)
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 or 1")
    return value == "1"


def fused_kernels() -> bool:
    return _flag("TANDEM_FUSED_KERNELS")


def pdl() -> bool:
    return _flag("TANDEM_PDL")


def fp8_v_bits() -> bool:
    return _flag("TANDEM_FP8_V_BITS")


def split_merge() -> bool:
    return _flag("TANDEM_SPLIT_MERGE")


def fused_rope() -> bool:
    return _flag("TANDEM_FUSED_ROPE")


def splitk() -> bool:
    return _flag("TANDEM_SPLITK")


def blas_slices() -> int | None:
    """TANDEM_BLAS_SLICES as an integer; None when unset."""
    value = _value("TANDEM_BLAS_SLICES")
    if not value:
        return None
    if value not in ("0", "1", "2", "4", "8"):
        raise ValueError(f"TANDEM_BLAS_SLICES={value!r}: expected 0, 1, 2, 4 or 8")
    return int(value)


def fp8_fused_quant() -> bool:
    return _flag("TANDEM_FP8_FUSED_QUANT")


def piecewise() -> bool:
    return _flag("TANDEM_PIECEWISE")


def blas() -> str:
    value = _value("TANDEM_BLAS")
    if value not in ("cublas", "cublaslt"):
        raise ValueError(f"TANDEM_BLAS={value!r}: expected 'cublaslt' or 'cublas'")
    return value


def moe_tiles() -> tuple[int, int, int, int] | None:
    """(block_n, block_k, num_warps, num_stages) from TANDEM_MOE_TILES; None when unset."""
    return parse_moe_tiles(_value("TANDEM_MOE_TILES"))


def parse_moe_tiles(value: str) -> tuple[int, int, int, int] | None:
    if not value:
        return None
    try:
        block_n, block_k, num_warps, num_stages = (int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"TANDEM_MOE_TILES={value!r}: expected four integers, "
            "block_n,block_k,num_warps,num_stages"
        ) from None
    powers = all(n >= 16 and n & (n - 1) == 0 for n in (block_n, block_k))
    if not powers or num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(
            f"TANDEM_MOE_TILES={value!r}: block_n and block_k powers of two >= 16, "
            "num_warps 1-16 (a power of two), num_stages >= 1"
        )
    return block_n, block_k, num_warps, num_stages


def decode_tiles() -> tuple[int, int, int] | None:
    """(block_n, num_warps, num_stages) from TANDEM_DECODE_TILES; None when unset."""
    return parse_decode_tiles(_value("TANDEM_DECODE_TILES"))


def decode_splits() -> int | None:
    """TANDEM_DECODE_SPLITS as an integer; None when unset."""
    value = _value("TANDEM_DECODE_SPLITS")
    if not value:
        return None
    if value not in ("1", "2", "4", "8", "16", "32"):
        raise ValueError(f"TANDEM_DECODE_SPLITS={value!r}: expected 1, 2, 4, 8, 16 or 32")
    return int(value)


def shared_prefix_tiles() -> tuple[int, int, int] | None:
    """(block_n, num_warps, num_stages) from TANDEM_SHARED_PREFIX_TILES; None when unset."""
    name = "TANDEM_SHARED_PREFIX_TILES"
    return parse_decode_tiles(_value(name), name)


def gluon_decode() -> str:
    value = _value("TANDEM_GLUON_DECODE")
    if value not in ("fp8", "all", "none"):
        raise ValueError(f"TANDEM_GLUON_DECODE={value!r}: expected 'fp8', 'all' or 'none'")
    return value


def fp8_decode_stages() -> int:
    value = _value("TANDEM_FP8_DECODE_STAGES")
    if not value.isdigit() or not 2 <= int(value) <= 8:
        raise ValueError(f"TANDEM_FP8_DECODE_STAGES={value!r}: expected an integer from 2 to 8")
    return int(value)


def fp8_decode_row_lanes() -> int:
    value = _value("TANDEM_FP8_DECODE_ROW_LANES")
    if value not in ("2", "4", "8"):
        raise ValueError(f"TANDEM_FP8_DECODE_ROW_LANES={value!r}: expected 2, 4 or 8")
    return int(value)


def decode_maxnreg() -> int | None:
    """TANDEM_DECODE_MAXNREG as an integer; None when unset."""
    value = _value("TANDEM_DECODE_MAXNREG")
    if not value:
        return None
    if not value.isdigit() or not 32 <= int(value) <= 255:
        raise ValueError(f"TANDEM_DECODE_MAXNREG={value!r}: expected an integer from 32 to 255")
    return int(value)


def parse_decode_tiles(
    value: str, name: str = "TANDEM_DECODE_TILES"
) -> tuple[int, int, int] | None:
    if not value:
        return None
    try:
        block_n, num_warps, num_stages = (int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(
            f"{name}={value!r}: expected three integers, block_n,num_warps,num_stages"
        ) from None
    if (
        block_n < 16
        or block_n & (block_n - 1)
        or num_warps not in (1, 2, 4, 8, 16)
        or num_stages < 1
    ):
        raise ValueError(
            f"{name}={value!r}: block_n a power of two >= 16, "
            "num_warps 1-16 (a power of two), num_stages >= 1"
        )
    return block_n, num_warps, num_stages


READERS = {
    "TANDEM_FUSED_KERNELS": fused_kernels,
    "TANDEM_PDL": pdl,
    "TANDEM_FP8_V_BITS": fp8_v_bits,
    "TANDEM_SPLIT_MERGE": split_merge,
    "TANDEM_FUSED_ROPE": fused_rope,
    "TANDEM_SPLITK": splitk,
    "TANDEM_BLAS_SLICES": blas_slices,
    "TANDEM_FP8_FUSED_QUANT": fp8_fused_quant,
    "TANDEM_PIECEWISE": piecewise,
    "TANDEM_BLAS": blas,
    "TANDEM_DECODE_TILES": decode_tiles,
    "TANDEM_DECODE_SPLITS": decode_splits,
    "TANDEM_SHARED_PREFIX_TILES": shared_prefix_tiles,
    "TANDEM_DECODE_MAXNREG": decode_maxnreg,
    "TANDEM_GLUON_DECODE": gluon_decode,
    "TANDEM_FP8_DECODE_STAGES": fp8_decode_stages,
    "TANDEM_FP8_DECODE_ROW_LANES": fp8_decode_row_lanes,
    "TANDEM_MOE_TILES": moe_tiles,
}


# switches renamed: set under the old name, a run says which to set instead
RENAMED = {"TANDEM_FP8_DECODE": "TANDEM_GLUON_DECODE (fp8, all or none; triton was none)"}


def check_all() -> None:
    """Validate every switch now (the CLI does, before it loads a model)."""
    for old, new in RENAMED.items():
        if old in os.environ:
            raise ValueError(f"{old} was renamed: set {new} instead")
    for read in READERS.values():
        read()


def current() -> dict[str, object]:
    """Every switch's value for this run, as a benchmark report records it."""
    return {name: read() for name, read in READERS.items()}
