"""Kernels' machine code, compiled for sm_90 on the CPU (Triton's wheel carries ptxas and
cuobjdump): the decode kernel's shared-memory reads over an FP8 cache counted in its SASS, the
shared-prefix kernel's copy waits, and the batch-1 MoE kernels compiling at all (the CPU tests
run them under the interpreter, which takes what the GPU compiler may not)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import triton

from tandem.attention.triton_backend import SHARED_PREFIX_TILES
from tandem.model.fused_moe import align_chunk_and_scan
from tandem.model.moe_routing import routing_tiles

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="needs the ptxas and cuobjdump of Triton's NVIDIA backend",
)

# an instruction line: /*0a10*/ [@P0 | @!UP1] OPCODE.MODIFIERS operands
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)")

# A kernel compiled for sm_90, in a fresh interpreter: under TRITON_INTERPRET=1 (the CPU tests)
# Triton defines the kernels for its interpreter. The kernel: a name in attention.triton_kernels,
# or "module:name". Its arguments as a launch specializes them: `types` (the rest int32, or
# int32 pointers), `constants` (a dtype as "tl.<name>"), and the pointers and `aligned`
# multiples of 16.
COMPILE = textwrap.dedent(
    """
    import importlib
    import json
    import sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, spec, num_warps, num_stages, out = sys.argv[1:]
    module, _, name = name.rpartition(":")
    module = importlib.import_module(module or "tandem.attention.triton_kernels")
    spec = json.loads(spec)
    kernel, constants = getattr(module, name), spec["constants"]
    constants = {n: getattr(tl, v[3:]) if str(v).startswith("tl.") else v
                 for n, v in constants.items() if n in kernel.arg_names}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else spec["types"].get(n, "*i32"
                 if n.endswith("_ptr") else "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n in spec["aligned"]]
    source = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=int(num_warps), num_stages=int(num_stages))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    open(out, "wb").write(compiled.asm["cubin"])
    """
)


def compile_sm90(
    name: str, spec: dict, tiles: tuple[int, int, int], cubin: Path
) -> tuple[str, int]:
    """(SASS, registers a thread) of kernel `name` compiled with `spec` (COMPILE's types,
    constants and aligned) at tiles (block_n, num_warps, num_stages)."""
    block_n, num_warps, num_stages = tiles
    spec = {**spec, "constants": {**spec["constants"], "BLOCK_N": block_n}}
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": src}
    args = [sys.executable, "-c", COMPILE, name, json.dumps(spec), str(num_warps),
            str(num_stages), str(cubin)]  # fmt: skip
    subprocess.run(args, env=env, check=True, timeout=300)
    return disassembled(cubin)


def disassembled(cubin: Path) -> tuple[str, int]:
    """(SASS, registers a thread) of the one kernel in `cubin`; no register spills."""

    def cuobjdump(flag: str) -> str:
        command = [str(BIN / "cuobjdump"), flag, str(cubin)]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    usage = cuobjdump("-res-usage")
    assert re.search(r"LOCAL:0\b", usage), usage
    return cuobjdump("-sass"), int(re.search(r"REG:(\d+)", usage).group(1))


def sass_ops(
    cache: str, tiles: tuple[int, int, int], tmp_path: Path, rope: bool = False
) -> collections.Counter:
    """{opcode with its modifiers: count} over decode_kernel's SASS at small's decode shape
    (Qwen3-0.6B: 16 heads over 8 KV heads, head dim 128, block size 16), and "registers": its
    registers a thread. `rope`: the kernel that norms, rotates and stores the new key (ROPE)."""
    spec = {
        "types": {"q_ptr": "*bf16", "out_ptr": "*bf16", "partial_out_ptr": "*fp32",
                  "partial_ml_ptr": "*fp32", "cache_ptr": "*" + cache, "kv_half_stride": "i64",
                  "scale": "fp32", "v_scale": "fp32", "k_ptr": "*bf16", "v_ptr": "*bf16",
                  "slot_ptr": "*i64", "cos_sin_ptr": "*fp32", "q_norm_ptr": "*bf16",
                  "k_norm_ptr": "*bf16", "eps": "fp32", "k_scale": "fp32"},
        "constants": dict(GROUP=2, GROUP_PAD=16, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128,
                          BLOCK_SIZE=16, MAX_SPLITS=32, SOFT_CAP=0.0, DIRECT=True, ORDERED=True,
                          CASCADE=False, EARLY_START=False, MERGE=False, ROPE=rope,
                          HAS_NORM=rope, PDL=False),
        "aligned": ["q_token_stride", "kv_half_stride", "k_token_stride", "v_token_stride"],
    }  # fmt: skip
    cubin = tmp_path / f"decode_{cache}_{int(rope)}.cubin"
    sass, registers = compile_sm90("decode_kernel", spec, tiles, cubin)
    ops = collections.Counter(OPCODE.findall(sass))
    ops["registers"] = registers
    return ops


@pytest.mark.parametrize("tiles", [(64, 2, 2), (128, 4, 3)])  # large-batch tiles, the default
def test_decode_over_an_fp8_cache_reads_v_from_shared_memory_by_ldmatrix_trans(tiles, tmp_path):
    """V converted to float16 before the dot: no byte-wise shared loads (before the conversion
    became asm: 384 LDS.U8 at 64, 2, 2); the float16 tile read by ldmatrix.trans, as a bfloat16
    cache's V (48 at both shapes)."""
    ops = sass_ops("fp8e4nv", tiles, tmp_path)
    assert ops["LDS.U8"] == 0
    assert ops["LDSM.16.MT88.4"] > 0
    assert ops["F2FP.F16.E4M3.UNPACK_B"] > 0  # the e4m3 conversion, a pair at a time


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_decode_with_the_rotary_and_store_keeps_its_registers_and_v_path(cache, tmp_path):
    """The decode kernel norming and rotating q and k and storing the new key (ROPE), at the
    default tiles: it compiles for sm_90, holds the registers of the kernel without it within
    16 (the rotary and the store come before the key loop, their values dead in it; with the
    new key put into its tile from registers it took 246-255), and an FP8 cache's V still goes
    through no byte-wise shared loads."""
    plain = sass_ops(cache, (128, 4, 3), tmp_path)
    rope = sass_ops(cache, (128, 4, 3), tmp_path, rope=True)
    assert rope["registers"] <= plain["registers"] + 16, (rope["registers"], plain["registers"])
    assert rope["LDS.U8"] == 0


# a wait for the copy groups in flight: DEPBAR.LE SB0, N leaves at most N of them unfinished
WAIT = re.compile(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)")


def copy_waits(tiles: tuple[int, int, int], tmp_path: Path) -> collections.Counter:
    """{groups left in flight: count} over the waits of shared_prefix_kernel's SASS at rollout's
    shape (Llama-3-8B: 32 heads over 8 KV heads, 8 samples of a prompt a group: 32 rows)."""
    spec = {
        "types": {"q_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_ml_ptr": "*fp32",
                  "cache_ptr": "*bf16", "scale": "fp32", "v_scale": "fp32"},
        "constants": dict(GROUP=4, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16,
                          SOFT_CAP=0.0, MAX_SPLITS=32, ROWS=32, PDL=False),
        "aligned": ["q_token_stride", "block_table_stride", "kv_half_stride"],
    }  # fmt: skip
    cubin = tmp_path / f"shared_{'_'.join(map(str, tiles))}.cubin"
    sass, _ = compile_sm90("shared_prefix_kernel", spec, tiles, cubin)
    return collections.Counter(int(n, 16) for n in WAIT.findall(sass))


def test_the_shared_prefix_kernel_keeps_copies_in_flight_at_its_default_stages(tmp_path):
    """Why SHARED_PREFIX_TILES takes 5 stages: each tile's block-table entries are loads its K
    and V copies depend on, so Triton's pipeliner gives each half the stages after the first,
    and below 5 every wait in the key loop drains all the copies in flight (0); at the default
    tiles some waits leave copy groups in flight, the next tiles' K and V loading while one is
    computed."""
    assert SHARED_PREFIX_TILES.num_stages >= 5
    assert max(copy_waits(SHARED_PREFIX_TILES, tmp_path)) > 0
    assert set(copy_waits(SHARED_PREFIX_TILES._replace(num_stages=4), tmp_path)) == {0}


def routing_spec(tiles: dict) -> dict:
    """`topk_softmax_kernel` at `tiles` over Qwen3-30B's router as a decode step gives it: 16
    float32 split-K slices of a bf16 product, top 8 renormalised, under PDL."""
    return {
        "types": {"logits_ptr": "*fp32", "weights_ptr": "*fp32"},
        "constants": dict(TOP_K=8, RENORMALIZE=True, **tiles, PARTS=16, ROUND_TO="tl.bfloat16",
                          PDL=True),
        "aligned": ["logits_stride", "part_stride"],
    }  # fmt: skip


def test_the_routing_of_bf16_logits_reduces_int32_keys_without_shuffles(tmp_path):
    """`topk_softmax_kernel` over the router's bf16 slices at 16 tokens x 128 experts a program
    (the tile int64 keys were measured at): each round's max of the int32 keys is one warp
    reduction (REDUX) where int64 keys took a tree of shuffles and selects."""
    spec = routing_spec(dict(BLOCK_T=16, BLOCK_E=128, BLOCK_K=8))
    cubin = tmp_path / "topk.cubin"
    sass, _ = compile_sm90("tandem.model.moe_routing:topk_softmax_kernel", spec, (64, 4, 1), cubin)
    ops = collections.Counter(OPCODE.findall(sass))
    assert ops["REDUX.MAX.S32"] >= 8  # at least one a round
    assert sum(n for op, n in ops.items() if op.startswith("SHFL")) < 100  # 364 with int64 keys


def test_a_decode_steps_routing_and_alignment_are_short_chains(tmp_path):
    """At Qwen3-30B's 32-token step (256 pairs over 128 experts) a program of each kernel is a
    chain of dependent instructions that sets its time: the routing's tile (`routing_tiles`)
    and the alignment's chunk (`align_chunk_and_scan`) keep it short, against 2,192 and 2,632
    instructions a thread at 16-row tiles and 64-pair chunks."""
    routing = routing_spec(routing_tiles(128, 8))
    chunk, scan = align_chunk_and_scan(256)
    align = {
        "types": {},
        "constants": dict(BLOCK_M=16, BINS=128, CHUNK=chunk, SCAN=scan, PDL=True),
        "aligned": [],
    }
    for name, spec, most in [("moe_routing:topk_softmax_kernel", routing, 1000),
                             ("fused_moe:align_kernel", align, 1300)]:  # fmt: skip
        cubin = tmp_path / f"{name.rpartition(':')[2]}.cubin"
        sass, _ = compile_sm90(f"tandem.model.{name}", spec, (64, 4, 1), cubin)
        assert len(OPCODE.findall(sass)) < most, name


MOE_ONE_TOKEN = {
    "norm_router_kernel": {
        "types": {"x_ptr": "*fp32", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16",
                  "router_ptr": "*bf16", "normed_ptr": "*bf16", "summed_ptr": "*bf16",
                  "out_ptr": "*fp32", "eps": "fp32"},
        "constants": dict(PARTS=8, BLOCK_H=2048, BLOCK_M=16, BLOCK_K=128, PDL=True),
        "aligned": ["hidden", "k_per_split", "part_stride"],
    },
    "routed_gate_up_kernel": {
        "types": {"logits_ptr": "*fp32", "x_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16",
                  "weights_ptr": "*fp32", "summed_ptr": "*bf16", "residual_ptr": "*bf16"},
        "constants": dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOP=8, PARTS=16,
                          ROUND_TO="tl.bfloat16", ROWS=128, COPY=True, BLOCK_H=2048, BLOCK_M=16,
                          BLOCK_K=128, PDL=True),
        "aligned": ["K", "N", "w_expert_stride", "w_row_stride", "c_stride"],
    },
}  # fmt: skip


@pytest.mark.parametrize("kernel", sorted(MOE_ONE_TOKEN))
def test_the_batch_1_moe_kernels_compile_for_sm90(kernel, tmp_path):
    """`moe_one_token`'s kernels as a Qwen3-30B-A3B batch-1 step launches them (bf16, under
    PDL, at the default MoE tiles): ptxas takes them, within the registers a thread has."""
    cubin = tmp_path / f"{kernel}.cubin"
    name = f"tandem.model.moe_one_token:{kernel}"
    _, registers = compile_sm90(name, MOE_ONE_TOKEN[kernel], (64, 4, 3), cubin)
    assert 0 < registers <= 255


def test_the_shared_expert_join_compiles_for_sm90(tmp_path):
    """`moe_shared.join_shared`'s kernel as a Qwen1.5-MoE-A2.7B decode step launches it (bf16,
    top 4, the down projection's float32 split-K slices, under PDL): ptxas takes it, within the
    registers a thread has."""
    spec = {
        "types": {"routed_ptr": "*bf16", "shared_ptr": "*fp32", "x_ptr": "*bf16",
                  "gate_ptr": "*bf16", "out_ptr": "*bf16"},
        "constants": dict(TOP_K=4, SHARED_PARTS=8, BLOCK_H=2048, BLOCK=1024, PDL=True),
        "aligned": ["hidden", "routed_token_stride", "routed_slot_stride", "shared_part_stride",
                    "shared_token_stride", "x_stride"],
    }  # fmt: skip
    cubin = tmp_path / "shared_join_kernel.cubin"
    _, registers = compile_sm90(
        "tandem.model.moe_shared:shared_join_kernel", spec, (64, 4, 1), cubin
    )
    assert 0 < registers <= 255


# the Gluon decode kernel (attention/gluon_decode.py) over e4m3 at small's shape, compiled as its
# launch specializes it
GLUON_COMPILE = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from tandem.attention import gluon_decode as f

    out, stages, cascade = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cascade"
    p, kernel = f.plan(), f.gluon_decode_kernel
    copy, shared = f.copy_layouts(1, f.ROW_LANES)
    constants = dict(GROUP=2, NUM_KV_HEADS=8, HEAD_DIM=f.HEAD_DIM, ROWS=f.ROWS, BLOCK_SIZE=16,
                     BLOCK_N=f.BLOCK_N, STAGES=stages, MAX_SPLITS=32, PRODUCT=gl.float16,
                     ORDERED=True, CASCADE=cascade, EARLY_START=cascade, PDL=True, COPY=copy,
                     SHARED=shared, **f._layout_args(p))
    types = dict(q_ptr="*bf16", out_ptr="*bf16", partial_out_ptr="*fp32", partial_ml_ptr="*fp32",
                 cache_ptr="*fp8e4nv", scale="fp32", v_scale="fp32", kv_half_stride="i64")
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "*i32" if n.endswith("_ptr")
                 else "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n in ("block_table_stride", "kv_half_stride")]
    source = GluonASTSource(
        fn=kernel, signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    open(out, "wb").write(compiled.asm["cubin"])
    """
)


def gluon_decode_sass(tmp_path: Path, stages: int, cascade: bool) -> tuple[str, list[str]]:
    """(SASS, the opcodes of the instructions that run) of the Gluon decode kernel over e4m3
    (GLUON_COMPILE); `cascade`: merging shared prefixes' partials, started early. ptxas pads
    with loads under the never-true predicate @!PT, which do not run."""
    cubin = tmp_path / "gluon_decode.cubin"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
    }
    mode = "cascade" if cascade else "plain"
    subprocess.run([sys.executable, "-c", GLUON_COMPILE, str(cubin), str(stages), mode], env=env,
                   check=True, timeout=300)  # fmt: skip
    sass, _ = disassembled(cubin)
    ops = [op for line in sass.splitlines() if "@!PT" not in line for op in OPCODE.findall(line)]
    return sass, ops


@pytest.mark.parametrize("stages", [3, 4])
def test_the_gluon_decode_reads_its_tiles_in_wide_loads_with_copies_in_flight(stages, tmp_path):
    """No register spills; no shared-memory stores but the copies (its reorderings move no
    data); each tile's K and V read by 16-byte loads and nothing narrower (8 each: 32 keys x 128
    bytes over 32 threads); the key loop waits with STAGES - 2 copy groups still in flight."""
    sass, ops = gluon_decode_sass(tmp_path, stages, cascade=False)
    assert not [op for op in ops if op.startswith("STS")]
    assert [op for op in ops if op.startswith("LDS")] == ["LDS.128"] * 16
    waits = WAIT.findall(sass)
    assert int(waits[0], 16) == stages - 2


def test_the_gluon_decode_started_early_reads_what_earlier_kernels_wrote_from_the_l2(tmp_path):
    """Started beside the shared-prefix kernel (EARLY_START), before its PDL wait the kernel
    reads q and the K/V tiles, written by kernels before that one: past the L1, from the L2
    (q's 2-byte loads `.STRONG.GPU`, the tiles' copies `LDGSTS.E.BYPASS.128`). Still no spills
    and the same 16-byte tile reads."""
    _, ops = gluon_decode_sass(tmp_path, 4, cascade=True)
    copies = [op for op in ops if op.startswith("LDGSTS")]
    assert copies and set(copies) == {"LDGSTS.E.BYPASS.128"}
    q_loads = [op for op in ops if op.startswith("LDG.E.U16")]
    assert len(q_loads) == 32 and set(q_loads) == {"LDG.E.U16.STRONG.GPU"}
    assert [op for op in ops if op.startswith("LDS")] == ["LDS.128"] * 16
