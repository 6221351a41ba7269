"""The `tandem` command: make-tiny-model, generate, chat."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from tandem.config import EngineConfig
from tandem.profiler import Timeline
from tandem.sampling import SamplingParams

ENGINE_ARGS = {f.name for f in fields(EngineConfig)} - {"model"}


def add_engine_args(parser: argparse.ArgumentParser, model_flag: bool = False) -> None:
    model_help = "a Hugging Face model folder, or a preset name with --load-format dummy"
    if model_flag:
        parser.add_argument("--model", required=True, help=model_help)
    else:
        parser.add_argument("model", help=model_help)
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"]
    )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention-backend", choices=["torch", "triton"], help="default: triton on CUDA"
    )
    parser.add_argument("--async-batching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--preemption-mode",
        default="auto",
        choices=["recompute", "swap", "auto"],
        help="when KV blocks run out: recompute, swap to host memory, or pick by cost (default)",
    )
    parser.add_argument(
        "--swap-space", type=float, default=4.0, help="GiB of pinned host memory for swapping"
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="GPUs (processes) per model"
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")


def check_output_path(flag: str, path: str | None) -> None:
    """Fail before a run, not after it, when its output file cannot be written where asked."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {target.parent} does not exist")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARGS if hasattr(args, name)}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_make_tiny_model(args: argparse.Namespace) -> None:
    from tandem.model.tiny import make_tiny_model

    print(make_tiny_model(args.out_dir, args.arch, seed=args.seed))


def cmd_generate(args: argparse.Namespace) -> None:
    from tandem.llm import LLM

    params = sampling_params(args)
    check_output_path("--trace", args.trace)
    llm = LLM(args.model, **engine_kwargs(args))
    if args.trace:
        llm.engine.start_trace()
    start = time.perf_counter()
    outputs = llm.generate(args.prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    for out in outputs:
        completion = out.outputs[0]
        print(
            f"--- prompt: {out.prompt!r}\n{completion.text!r}  [{completion.finish_reason}, {len(completion.token_ids)} tokens]"
        )
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    mode = "async" if llm.engine.async_batching else "sync"
    print(
        f"{len(outputs)} requests, {num_out} tokens in {elapsed:.2f} s ({num_out / elapsed:.0f} tok/s, {mode})"
    )
    if args.trace:
        metadata = {"mode": mode, "model": args.model}
        save_trace(llm.engine.stop_trace(), args.trace, elapsed, metadata)


def save_trace(timeline: Timeline, path: str, elapsed: float, metadata: dict) -> None:
    """Write a recorded timeline as a Chrome trace; print its summary and recording overhead."""
    from tandem.trace import format_summary, summarize

    trace = timeline.to_chrome_trace(metadata)
    with open(path, "w") as f:
        json.dump(trace, f)
    print(format_summary(summarize(trace)))
    overhead_pct = 100 * timeline.overhead_ns / 1e9 / elapsed
    print(f"trace: {path} (recording overhead {overhead_pct:.2f}% of {elapsed:.2f} s wall time)")


def cmd_trace_summarize(args: argparse.Namespace) -> None:
    from tandem.trace import format_summary, load_trace, summarize

    summary = summarize(load_trace(args.path))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))


def cmd_trace_plot(args: argparse.Namespace) -> None:
    from tandem.plot import plot_timeline
    from tandem.trace import load_trace

    plot_timeline(load_trace(args.path), args.output, args.window_steps)
    print(args.output)


def cmd_chat(args: argparse.Namespace) -> None:
    from tandem.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: empty line or Ctrl-D to quit")
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        print(f"assistant: {reply}", flush=True)


def cmd_bench(args: argparse.Namespace) -> None:
    from tandem.bench import cmd_bench

    check_output_path("--output-json", getattr(args, "output_json", None))
    check_output_path("--trace", getattr(args, "trace", None))
    cmd_bench(args, engine_kwargs(args))


def cmd_serve(args: argparse.Namespace) -> None:
    from tandem.async_llm import AsyncLLM
    from tandem.server.app import serve

    llm = AsyncLLM.from_model(args.model, **engine_kwargs(args))
    serve(llm, args.served_model_name or args.model, args.host, args.port, args.api_key)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser(
        "make-tiny-model", help="write a small random checkpoint in Hugging Face format"
    )
    tiny.add_argument("out_dir")
    tiny.add_argument("--arch", choices=["llama", "mistral", "qwen2", "qwen3"], default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny_model)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    add_sampling_args(gen)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.add_argument("--trace", metavar="PATH", help="record a CPU/GPU timeline to this JSON")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat on stdin with the model's chat template")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default="")
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", help="the model name clients send (default: MODEL)")
    serve.set_defaults(func=cmd_serve)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="mode", required=True)
    from tandem.bench import add_bench_args

    throughput = bench.add_parser(
        "throughput", help="offline throughput: every request submitted at once"
    )
    add_engine_args(throughput, model_flag=True)
    add_bench_args(throughput)
    throughput.set_defaults(func=cmd_bench)
    bench_serve = bench.add_parser(
        "serve", help="concurrent streaming requests to a running server"
    )
    from tandem.server.bench import add_bench_serve_args, cmd_bench_serve

    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    latency = bench.add_parser(
        "latency", help="TTFT / TPOT / ITL percentiles, requests arriving --batch-size at a time"
    )
    add_engine_args(latency, model_flag=True)
    add_bench_args(latency, latency=True)
    latency.set_defaults(func=cmd_bench)

    trace = sub.add_parser("trace", help="read a Chrome trace written with --trace")
    actions = trace.add_subparsers(dest="action", required=True)
    summarize = actions.add_parser("summarize", help="GPU-active %%, idle gaps, CPU phase times")
    summarize.add_argument("path")
    summarize.add_argument("--json", action="store_true", help="print the summary dict as JSON")
    summarize.set_defaults(func=cmd_trace_summarize)
    plot = actions.add_parser("plot", help="PNG: whole-run GPU busy vs idle, a few steps zoomed")
    plot.add_argument("path")
    plot.add_argument("-o", "--output", required=True, metavar="PNG")
    plot.add_argument("--window-steps", type=int, default=6, help="steps in the zoomed window")
    plot.set_defaults(func=cmd_trace_plot)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as error:
        sys.exit(f"tandem: error: {error}")


if __name__ == "__main__":
    main()
