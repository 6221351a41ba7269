"""Weights from a trainer process (weight_transfer/): how long a whole model takes to go in, and
at what rate, through "ipc" (a trainer on the engine's GPU hands over CUDA IPC handles of a
packed buffer) or "nccl" (a trainer on GPU 1 broadcasts; gloo between CPU processes without
CUDA). The trainer sends the engine's own dummy weights, so the weights after the update must
equal those before, bit for bit; the run checks that (each parameter's bits summed, before and
after), and reports whether the greedy tokens agree too (each run from a cold prefix cache).

Usage: PYTHONPATH=src python3 benchmarks/weight_transfer.py [--model llama-3-8b]
       [--backend ipc|nccl] [--packed-mb 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import time

import torch

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.model.loader import DUMMY_SEED_SALT, read_hf_config
from tandem.model.tiny import random_weights, weight_specs
from tandem.parallel import free_port

GIB = 2**30


def dummy_weights(model: str, seed: int, dtype: torch.dtype, device: str):
    """The engine's dummy weights, drawn again (the loader's generator gives the same numbers)."""
    hf_config, _ = read_hf_config(model)
    return list(random_weights(hf_config, seed ^ DUMMY_SEED_SALT, dtype, device))


def trainer(args: argparse.Namespace, dtype: torch.dtype, init_info: dict, pipe) -> None:
    """The trainer's process: the weights on its device, sent `repeats` times on request."""
    from tandem.weight_transfer import IPCWeightTransferEngine, NCCLWeightTransferEngine

    cuda = torch.cuda.is_available()
    device = "cpu" if not cuda else ("cuda:0" if args.backend == "ipc" else "cuda:1")
    if cuda:
        torch.cuda.set_device(device)
    pairs = dummy_weights(args.model, 0, dtype, device)
    group = NCCLWeightTransferEngine.trainer_init(init_info) if args.backend == "nccl" else None
    buffer = args.packed_mb * 2**20

    def through_pipe(info) -> None:
        pipe.send(dataclasses.asdict(info))
        assert pipe.recv() == "copied"

    while pipe.recv() == "send":
        if group is not None:
            NCCLWeightTransferEngine.trainer_send_weights(
                iter(pairs), {"group": group, "packed": True, "packed_buffer_size_bytes": buffer}
            )
        else:
            IPCWeightTransferEngine.trainer_send_weights(
                iter(pairs),
                {"send_mode": through_pipe, "packed": True, "packed_buffer_size_bytes": buffer},
            )
        pipe.send("sent")


def fingerprint(llm: LLM) -> list[int]:
    """Each parameter's bits summed as integers: equal weights give equal sums."""
    integer = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    return [
        int(p.detach().view(integer[p.element_size()]).sum(dtype=torch.int64))
        for p in llm.engine.model.parameters()
    ]


def greedy(llm: LLM) -> list[list[int]]:
    llm.reset_prefix_cache()  # every run computes its prompts whole, as after an update
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % vocab for j in range(40)]} for i in range(8)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--backend", choices=["ipc", "nccl"], default="ipc")
    parser.add_argument("--packed-mb", type=int, default=1024, help="packed buffer size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        weight_transfer_config={"backend": args.backend},
    )
    dtype = llm.engine.dtype
    nbytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    weights = fingerprint(llm)
    before = greedy(llm)
    repeatable = greedy(llm) == before  # without an update: are the greedy tokens run to run?
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
    }
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=trainer, args=(args, dtype, init_info, theirs))
    process.start()
    llm.init_weight_transfer_engine({"init_info": init_info if args.backend == "nccl" else {}})
    specs = weight_specs(ModelConfig.from_hf(read_hf_config(args.model)[0]))
    announced = {  # the names and shapes random_weights draws, in its order
        "names": list(specs),
        "dtype_names": [str(dtype).removeprefix("torch.")] * len(specs),
        "shapes": [list(shape) for shape, _, _ in specs.values()],
        "packed": True,
        "packed_buffer_size_bytes": args.packed_mb * 2**20,
    }
    seconds = []
    for _ in range(args.repeats):
        llm.start_weight_update()
        start = time.perf_counter()
        ours.send("send")
        if args.backend == "nccl":
            llm.update_weights({"update_info": announced})
            assert ours.recv() == "sent"
        else:
            while (message := ours.recv()) != "sent":
                llm.update_weights({"update_info": message})
                ours.send("copied")
        llm.finish_weight_update()
        seconds.append(time.perf_counter() - start)
    ours.send("stop")
    process.join()
    unchanged = fingerprint(llm) == weights
    same = greedy(llm) == before
    median = statistics.median(seconds)
    print(
        f"{args.model} ({nbytes / GIB:.2f} GiB, {dtype}), backend {args.backend}, packed "
        f"{args.packed_mb} MiB: {median:.2f} s a whole update (median of "
        f"{', '.join(f'{s:.2f}' for s in seconds)}), {nbytes / GIB / median:.1f} GiB/s; "
        f"weights after identical: {unchanged}; greedy tokens after identical: {same} (a second "
        f"run before any update: {repeatable})"
    )
    assert unchanged, "the update changed the weights it should have written back as they were"
    assert same or not repeatable, "the update changed the model's greedy tokens"


if __name__ == "__main__":
    main()
