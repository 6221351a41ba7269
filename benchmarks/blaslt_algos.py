"""cuBLASLt's candidate kernels for the step's GEMMs, each timed: is its first pick the fastest?

torch asks cuBLASLt's heuristic for one algorithm per shape and runs it. This asks for up to
--count, times each from a CUDA graph replay on cold weights (as `gemm.py` does), checks each
against F.linear, and prints them fastest first beside F.linear's time. --sustain S then
times F.linear and the fastest few again under S seconds of sustained load each (`power.py`),
where the power cap sets the clock, as in rollout's decode steps.
Usage: PYTHONPATH=src python benchmarks/blaslt_algos.py [--model llama-3-8b] [--rows 128 256]
[--sustain 2]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os

import torch
import torch.nn.functional as F
from gemm import GEMM_PEAK, Rotation, matrices, time_us
from power import Board, sustained

from tandem.config import ModelConfig
from tandem.model.loader import read_hf_config

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
OP_N, OP_T = 0, 1
WORKSPACE = 64 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load_cublaslt() -> ctypes.CDLL:
    site = os.path.dirname(os.path.dirname(torch.__file__))
    paths = sorted(glob.glob(f"{site}/nvidia/**/libcublasLt.so*", recursive=True))
    paths += sorted(glob.glob(f"{os.path.dirname(torch.__file__)}/lib/libcublasLt.so*"))
    if not paths:
        raise FileNotFoundError("libcublasLt not found beside torch")
    return ctypes.CDLL(paths[0])


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class Matmul:
    """y[rows, out] = x[rows, in] @ W[out, in]^T in bf16 with float32 accumulation, through
    cuBLASLt with a chosen algorithm (column-major: y^T = W^T' x^T, W transposed)."""

    def __init__(self, lt: ctypes.CDLL, rows: int, out: int, inp: int):
        self.lt = lt
        self.handle = ctypes.c_void_p()
        check(lt.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.desc = ctypes.c_void_p()
        check(
            lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
            "desc",
        )
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            check(
                lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4),
                "trans",
            )
        self.a, self.b, self.c = (ctypes.c_void_p() for _ in range(3))
        for layout, (r, c, ld) in zip(
            (self.a, self.b, self.c),
            ((inp, out, inp), (inp, rows, inp), (out, rows, out)),
            strict=True,
        ):
            check(
                lt.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout),
                    CUDA_R_16BF,
                    ctypes.c_uint64(r),
                    ctypes.c_uint64(c),
                    ctypes.c_int64(ld),
                ),
                "layout",
            )
        self.pref = ctypes.c_void_p()
        check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "pref")
        size = ctypes.c_uint64(WORKSPACE)
        check(
            lt.cublasLtMatmulPreferenceSetAttribute(
                self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8
            ),
            "workspace",
        )
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(0.0)
        self.rows, self.out = rows, out

    def candidates(self, count: int) -> list[Heuristic]:
        results = (Heuristic * count)()
        found = ctypes.c_int()
        check(
            self.lt.cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.desc,
                self.a,
                self.b,
                self.c,
                self.c,
                self.pref,
                count,
                results,
                ctypes.byref(found),
            ),
            "heuristic",
        )
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, algo: Heuristic) -> torch.Tensor:
        y = torch.empty(self.rows, self.out, dtype=torch.bfloat16, device="cuda")
        check(
            self.lt.cublasLtMatmul(
                self.handle,
                self.desc,
                ctypes.byref(self.alpha),
                ctypes.c_void_p(weight.data_ptr()),
                self.a,
                ctypes.c_void_p(x.data_ptr()),
                self.b,
                ctypes.byref(self.beta),
                ctypes.c_void_p(y.data_ptr()),
                self.c,
                ctypes.c_void_p(y.data_ptr()),
                self.c,
                ctypes.byref(algo.algo),
                ctypes.c_void_p(self.workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE),
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ),
            "matmul",
        )
        return y


def describe(algo: Heuristic) -> str:
    """The algorithm's id and its packed configuration words, as cuBLASLt hands them back."""
    words = list(algo.algo.data)
    return f"id {words[0] & 0xFFFFFFFF} cfg " + " ".join(f"{w:x}" for w in words[1:5])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--matrices", nargs="+", default=["qkv", "o", "gate_up", "down", "lm_head"])
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--sustain", type=float, default=0.0, help="seconds a candidate")
    parser.add_argument("--sustain-top", type=int, default=4, help="candidates sustained")
    args = parser.parse_args()
    board = Board() if args.sustain else None
    cfg = ModelConfig.from_hf(read_hf_config(args.model)[0])
    lt = load_cublaslt()
    torch.manual_seed(0)
    for name, (out, inp) in matrices(cfg).items():
        if name not in args.matrices:
            continue
        weight = torch.randn(out, inp, dtype=torch.bfloat16, device="cuda") / inp**0.5
        rotation = Rotation(weight)
        for rows in args.rows:
            x = torch.randn(rows, inp, dtype=torch.bfloat16, device="cuda")
            ideal = 2 * rows * out * inp / GEMM_PEAK * 1e6
            base = time_us(lambda x, r=rotation: F.linear(x, r.next()), x)
            reference = F.linear(x, weight).float()
            mm = Matmul(lt, rows, out, inp)
            timed = []
            for i, algo in enumerate(mm.candidates(args.count)):
                error = (mm(x, weight, algo).float() - reference).abs().max().item()
                if error > 0.05:
                    timed.append((float("inf"), i, algo, error))
                    continue
                us = time_us(lambda x, a=algo, m=mm, r=rotation: m(x, r.next(), a), x)
                timed.append((us, i, algo, error))
            timed.sort(key=lambda t: t[0])
            print(
                f"{name} {rows} x {out} x {inp}: F.linear {base:.1f} us ({ideal / base:.1%} of "
                f"{ideal:.1f}); {len(timed)} candidates",
                flush=True,
            )
            for us, i, algo, error in timed[:8]:
                print(
                    f"  #{i:<2} {us:7.1f} us ({ideal / us:.1%}) waves {algo.waves_count:.2f} "
                    f"ws {algo.workspace_size >> 10} KiB err {error:.3g} {describe(algo)}"
                )
            first = next((t for t in timed if t[1] == 0), None)
            if first is not None:
                print(f"  heuristic's first: {first[0]:.1f} us")
            if board is not None:
                print("  sustained (F.linear, then the fastest; twice, the second round reversed):")
                runs = [("F.linear", lambda x=x, r=rotation: F.linear(x, r.next()))]
                for us, i, algo, _ in timed[: args.sustain_top]:
                    if us < float("inf"):
                        runs.append(
                            (f"#{i}", lambda x=x, a=algo, m=mm, r=rotation: m(x, r.next(), a))
                        )
                results = {label: [] for label, _ in runs}
                for order in (runs, runs[::-1]):
                    for label, fn in order:
                        results[label].append(sustained(fn, board, args.sustain))
                for label, pair in results.items():
                    print(f"  {label:>8} " + " | ".join(str(r) for r in pair))


if __name__ == "__main__":
    main()
