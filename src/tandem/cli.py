"""tandem: an LLM inference engine whose CPU prepares step N+1 while the GPU computes step N."""

from __future__ import annotations

import argparse
import decimal
import importlib.util
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from tandem import config_file, envs
from tandem.config import (
    EXECUTOR_BACKENDS,
    FIT_TO_CACHE,
    LOGPROBS_MODES,
    ONE_BEHAVIOUR,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from tandem.reasoning import PARSERS as REASONING_PARSERS

if TYPE_CHECKING:
    from tandem.profiler import Timeline
    from tandem.sampling import SamplingParams
    from tandem.server.options import ServerOptions

# the serving commands' own flags of these names name the server's model and its replicas
ENGINE_ARGS = {f.name for f in fields(EngineConfig)} - {
    "model", "served_model_name", "data_parallel_size",
    "chat_template",  # --chat-template is the server's (ServerOptions), not the engine's
}  # fmt: skip
# tandem chat's flags of a running server's (add_client_args), and those both of its kinds take
CLIENT_ARGS = ("url", "model_name", "api_key", "stats")
CHAT_ARGS = (*CLIENT_ARGS, "system", "quick")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help says what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (`--max-tok` is an error, not --max-tokens), defaults in the help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.set_defaults(command_parser=self)  # the innermost one wins: for misspelt flags


def add_engine_args(parser: argparse.ArgumentParser, model_flag: str = "positional") -> None:
    """model_flag: how the model is named: "positional" (MODEL), "optional" (MODEL or none),
    "option" (--model MODEL) or "either" (as vLLM's serve and run-batch take it;
    `resolve_model` picks one)."""
    model_help = "a Hugging Face model folder or Hub repository id, or a preset name with --load-format dummy"
    if model_flag == "option":
        parser.add_argument("--model", required=True, help=model_help)
    elif model_flag == "positional":
        parser.add_argument("model", help=model_help)
    elif model_flag == "optional":
        parser.add_argument("model", nargs="?", help=model_help)
    else:
        parser.add_argument("model", nargs="?", help=model_help)
        parser.add_argument(
            "--model", dest="model_option", metavar="MODEL", help="MODEL, given as an option"
        )
    parser.add_argument(
        "--tokenizer",
        help="a folder or Hub repository whose tokenizer.json to use (default: the model's own)",
    )
    parser.add_argument(
        "--revision", help="a Hub model's branch, tag or commit (default: its default branch)"
    )
    parser.add_argument(
        "--tokenizer-revision", help="the tokenizer's branch, tag or commit, from the Hub"
    )
    parser.add_argument(
        "--download-dir", help="where Hub models are downloaded (default: the Hub's cache)"
    )
    parser.add_argument(
        "--hf-token",
        nargs="?",
        const=True,
        help="the Hub's token for private or gated models (bare flag: the saved login's)",
    )
    parser.add_argument(
        "--hf-overrides",
        type=json_object,
        help="JSON of config.json fields to change, e.g. '{\"rope_theta\": 1000000}'",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        choices=list(EXECUTOR_BACKENDS),
        help="vLLM's; tandem starts its tensor-parallel ranks itself ('mp')",
    )
    for name, (values, behaviour) in ONE_BEHAVIOUR.items():  # --tokenizer-mode, ...
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, default=values[0], choices=values, help=f"vLLM's; {behaviour}")
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=list(SCHEDULING_POLICIES),
        help="vLLM's: first come, first served, or by each request's priority (lower first, "
        "then arrival)",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16", "half", "float"],
        help="weights and activations; auto: the checkpoint's (float32 on the CPU)",
    )
    parser.add_argument(
        "--max-model-len",
        type=max_model_len,
        help="prompt + output tokens, e.g. 4096, 32k (x1000) or 32K (x1024), as vLLM's (default: "
        "the model's)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    parser.add_argument(
        "--max-num-scheduled-tokens",
        type=int,
        help="vLLM's: tokens per step, at most --max-num-batched-tokens, which it lowers",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument(
        "--num-blocks", type=int, help="KV cache blocks (default: sized from the device memory)"
    )
    parser.add_argument("--num-gpu-blocks-override", type=int, help="vLLM's name for --num-blocks")
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="the KV cache's size in bytes, in place of --gpu-memory-utilization's sizing",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory the engine may fill",
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="the checkpoint's safetensors files (auto, safetensors), or random weights of the "
        "model's shape (dummy)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights and samples")
    parser.add_argument(
        "--attention-backend", choices=["torch", "triton"], help="default: triton on CUDA"
    )
    parser.add_argument(
        "--async-batching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build step N+1 while step N runs",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's name for --async-batching",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="vLLM's; 1 only (use --tensor-parallel-size, or --data-parallel-size to serve)",
    )
    parser.add_argument(
        "--logits-processors",
        nargs="+",
        metavar="MODULE:CLASS",
        help="custom logits processors (vLLM's): LogitsProcessor subclasses by name",
    )
    parser.add_argument(
        "--speculative-config",
        type=json_object,
        help="vLLM's; speculative decoding is not supported (refused)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps as CUDA graphs (default: on with CUDA)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="taken for vLLM's command line: tandem runs no code from a checkpoint",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly, no CUDA graphs (vLLM's flag; as --no-cuda-graphs)",
    )
    parser.add_argument(
        "--disable-cascade-attn",
        action="store_true",
        help="vLLM's: decode rows that share leading blocks read them each (no shared-prefix "
        "attention)",
    )
    parser.add_argument(
        "-O",
        "--compilation-config",
        type=compilation_arg,
        help="vLLM's: JSON whose CUDA-graph options (cudagraph_mode, cudagraph_capture_sizes, "
        "max_cudagraph_capture_size) shape the graphs, or a level (-O3: taken, no effect)",
    )
    parser.add_argument(
        "--cudagraph-capture-sizes",
        type=int,
        nargs="+",
        metavar="ROWS",
        help="vLLM's -O.cudagraph_capture_sizes: the decode graphs' row counts",
    )
    parser.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        metavar="ROWS",
        help="vLLM's -O.max_cudagraph_capture_size: no decode graph of more rows",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached prompt prefixes (default: on)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's; refused: tandem splits a MoE model's experts by tensor parallelism",
    )
    parser.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=0,
        help="vLLM's; only 0: the weights stay in device memory",
    )
    # more of vLLM's flags that tandem takes at the values asking for its own behaviour (the
    # engine says why another is refused: config.UNUSED_VLLM_OPTIONS)
    for flag, what in (
        ("--disable-sliding-window", "a windowed model attends over its window"),
        ("--calculate-kv-scales", "an FP8 cache's scales are the checkpoint's"),
        ("--enable-eplb", "tandem splits a MoE model's experts by tensor parallelism"),
        ("--enable-dbo", "a step runs as one batch"),
    ):
        parser.add_argument(flag, action="store_true", help=f"vLLM's; refused: {what}")
    parser.add_argument(
        "--language-model-only",
        action="store_true",
        help="vLLM's; taken: tandem serves text models alone",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=json_object,
        metavar="JSON",
        help='vLLM\'s; only counts of 0 (e.g. {"image": 0}): tandem serves text models',
    )
    parser.add_argument(
        "--kv-transfer-config",
        type=json_object,
        metavar="JSON",
        help="vLLM's; refused: no KV cache moves between engines",
    )
    parser.add_argument(
        "--worker-extension-cls",
        metavar="PATH",
        help="vLLM's: package.module.Class, whose methods collective_rpc may name (each rank's "
        "engine their self): POST /collective_rpc with VLLM_SERVER_DEV_MODE=1",
    )
    for flag, default in (
        ("--max-num-partial-prefills", 1),
        ("--max-long-partial-prefills", 1),
        ("--long-prefill-token-threshold", 0),
        ("--num-lookahead-slots", 0),
    ):
        parser.add_argument(
            flag, type=int, default=default, help=f"vLLM's; only {default}, vLLM's default"
        )  # fmt: skip
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split a prompt longer than a step's token budget over steps (default: on; tandem "
        "has no other way)",
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="run LoRA adapters that requests name"
    )
    parser.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help="take prompts given as embeddings ({'prompt_embeds': tensor})",
    )
    parser.add_argument("--max-loras", type=int, default=1, help="LoRA adapters in one step")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the highest adapter rank")
    parser.add_argument(
        "--max-cpu-loras", type=int, help="adapters kept read in host memory (default: max loras)"
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
        "--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (processes) per model"
    )
    parser.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        help="fp8: FP8 weights of a bf16 checkpoint; gptq, awq, compressed-tensors: the "
        "checkpoint's int4 format (random int4 weights with --load-format dummy); default: the "
        "checkpoint's own",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="fp8: an e4m3 KV cache, half the bytes (default: auto, the model dtype)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-identical outputs whatever else is batched (one device; slower)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), "
        "or a folder with a generation_config.json",
    )
    parser.add_argument(
        "--override-generation-config",
        type=json_object,
        help="JSON of sampling defaults on top, e.g. '{\"temperature\": 0.5}'",
    )
    parser.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=list(LOGPROBS_MODES),
        help="what sample logprobs hold: the model's log-softmax or logits (raw_*), or those "
        "the sampler draws from after penalties, temperature and top-k/top-p/min-p "
        "(processed_*) (default: raw_logprobs)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most top ids a request's logprobs or prompt_logprobs may ask for (at most 20)",
    )
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: prompts come as token ids, outputs carry no text",
    )
    parser.add_argument(
        "--tokens-only",
        action="store_true",
        help="vLLM's: token ids in and out (/inference/v1/generate), as --skip-tokenizer-init",
    )
    for flag in ("--enable-sleep-mode", "--disable-custom-all-reduce"):
        parser.add_argument(flag, action="store_true", help="taken as vLLM's; no effect here")
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        default=True,
        help="taken as vLLM's; the default here (stats every 10 s: LLM(disable_log_stats=False))",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="vLLM's: a stream sends a request's tokens once this many have come (the first and "
        "the last at once)",
    )
    parser.add_argument(
        "--structured-outputs-config",
        help="vLLM's: JSON of the grammar options (backend 'xgrammar', disable_any_whitespace, "
        "reasoning_parser, ...)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_PARSERS),
        help="the model's thinking (<think>...</think>): a structured-output grammar starts "
        "after it, and the server puts it in message.reasoning (default: none)",
    )
    parser.add_argument(
        "--profiler-config",
        type=json_object,
        help="JSON of vLLM's profiler settings for start/stop_profile, e.g. "
        '\'{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}\'',
    )
    parser.add_argument(
        "--weight-transfer-config",
        type=json_object,
        help="let a trainer process broadcast weights (POST /init_weight_transfer_engine, "
        '/update_weights), e.g. \'{"backend": "nccl"}\' (NCCL on CUDA, gloo on CPU)',
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    parser.add_argument("--min-p", type=float, default=0.0, help="0: no min-p")
    parser.add_argument(
        "--sampling-seed", type=int, help="seed of the samples (default: drawn from --seed)"
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="a stop string; repeat for several"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="go on past end-of-sequence tokens"
    )


def compilation_arg(text: str) -> dict | int:
    """An argparse type: vLLM's -O, a level (an int) or a JSON object."""
    return int(text) if text.strip().isdigit() else json_object(text)


def json_object(text: str) -> dict:
    """An argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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
    from tandem.sampling import SamplingParams

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
    if args.model is None:  # vLLM's: a running server's
        from tandem.server import client

        if flags := [f for dest, f in given_options(args).items() if dest not in CHAT_ARGS]:
            raise ValueError(
                f"{', '.join(flags)}: with no MODEL the server's settings answer (give a MODEL "
                "to chat with it loaded here)"
            )
        server = client.connect(args.url, args.model_name, args.api_key, sys.stdout)
        client.chat(server, sys.stdin, sys.stdout, args.system, args.quick, args.stats)
        return
    if flags := [f for dest, f in given_options(args).items() if dest in CLIENT_ARGS]:
        raise ValueError(f"{', '.join(flags)}: a running server's; MODEL is loaded here")
    from tandem.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.quick is not None:
        print(llm.chat([*messages, {"role": "user", "content": args.quick}], params,
                       use_tqdm=False)[0].outputs[0].text)  # fmt: skip
        return
    print("chat: empty line or Ctrl-D to quit")
    for line in sys.stdin:
        if not line.strip():
            break
        messages.append({"role": "user", "content": line.strip()})
        try:
            reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        except ValueError as error:  # e.g. past max_model_len: the conversation so far stays
            messages.pop()
            print(f"chat: {error}; that message was dropped", file=sys.stderr, flush=True)
            continue
        messages.append({"role": "assistant", "content": reply})
        print(f"assistant: {reply}", flush=True)


def cmd_complete(args: argparse.Namespace) -> None:
    from tandem.server import client

    server = client.connect(args.url, args.model_name, args.api_key, sys.stdout)
    client.complete(server, sys.stdin, sys.stdout, args.max_tokens, args.quick, args.stats)


def cmd_collect_env(args: argparse.Namespace) -> None:
    from torch.utils import collect_env

    from tandem import __version__

    collect_env.main()
    print(f"tandem version: {__version__}")


def given_options(args: argparse.Namespace) -> dict[str, str]:
    """Each option of the command that the command line set to other than its default: its
    destination -> its flag."""
    return {
        action.dest: action.option_strings[0]
        for action in args.command_parser._actions
        if action.option_strings
        and action.default is not argparse.SUPPRESS
        and getattr(args, action.dest, action.default) != action.default
    }


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's chat and complete flags: the running server to ask (tandem.server.client)."""
    parser.add_argument(
        "--url",
        default="http://localhost:8000/v1",
        help="the running server's OpenAI API root (default: %(default)s)",
    )
    parser.add_argument(
        "--model-name", help="the served model to ask (default: the first that /models lists)"
    )
    parser.add_argument("--api-key", help="the server's API key (default: OPENAI_API_KEY's)")
    parser.add_argument(
        "--stats",
        action="store_true",
        help="after each answer, its time to the first token and its tokens per second",
    )


def cmd_bench(args: argparse.Namespace) -> None:
    from tandem.bench import cmd_bench

    check_output_path("--output-json", getattr(args, "output_json", None))
    check_output_path("--trace", getattr(args, "trace", None))
    cmd_bench(args, engine_kwargs(args))


def cmd_bench_startup(args: argparse.Namespace) -> None:
    from tandem.bench_startup import cmd_bench_startup

    check_output_path("--output-json", args.output_json)
    cmd_bench_startup(args, engine_kwargs(args))


def cmd_serve(args: argparse.Namespace) -> None:
    from tandem.async_llm import AsyncLLM
    from tandem.server.lifecycle import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: a port is in 0-65535")
    check_data_parallel_size(args.data_parallel_size)
    adapters = lora_modules(args.lora_modules, args.enable_lora)
    if args.data_parallel_size > 1 and adapters:
        raise ValueError("--lora-modules is served by one engine (--data-parallel-size 1)")
    options = server_options(args, adapters)
    options.validate()
    if args.data_parallel_size > 1 and options.one_server_only():
        flags = ", ".join(options.one_server_only())
        raise ValueError(f"{flags}: one server's, not Ray Serve's (--data-parallel-size 1)")
    if args.data_parallel_size > 1:  # every replica serves with these options
        from tandem.ray.serve import serve_data_parallel

        serve_data_parallel(
            args.model,
            engine_kwargs(args),
            args.data_parallel_size,
            args.host,
            args.port,
            args.served_model_name,
            options,
        )
        return
    llm = AsyncLLM.from_model(args.model, **engine_kwargs(args))
    if serve(llm, args.served_model_name or args.model, args.host, args.port, options):
        sys.exit(f"tandem: error: the engine failed ({llm.failure!r}); the server stopped")


def server_options(args: argparse.Namespace, adapters: tuple) -> ServerOptions:
    """The serve flags as ServerOptions: each field from the flag of its name (a list as a
    tuple), the LoRA modules as read."""
    from tandem.server.options import ServerOptions

    given = {f.name: getattr(args, f.name) for f in fields(ServerOptions) if hasattr(args, f.name)}
    given = {name: tuple(v) if isinstance(v, list) else v for name, v in given.items()}
    if not given.get("api_key"):  # vLLM's: the flag, else the environment's key
        given["api_key"] = os.environ.get("VLLM_API_KEY") or None
    given["allow_runtime_lora_updating"] |= env_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    given["server_dev_mode"] |= env_flag("VLLM_SERVER_DEV_MODE")
    given["log_error_stack"] |= env_flag("VLLM_SERVER_DEV_MODE")  # vLLM's default
    return ServerOptions(**{**given, "lora_modules": adapters})


def env_flag(name: str) -> bool:
    """A vLLM boolean variable, read as vLLM reads it: "1" or "true" (any case) is on."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def lora_modules(specs: list[str] | None, enable_lora: bool) -> tuple:
    """--lora-modules' NAME=PATH (or vLLM's JSON {"name", "path"}) as LoRARequests, ids from 1."""
    from tandem.lora.request import LoRARequest

    if specs and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    adapters = []
    for lora_id, spec in enumerate(specs or [], start=1):
        if spec.lstrip().startswith("{"):
            fields = json.loads(spec)  # a ValueError where it is no JSON
            fields = fields if isinstance(fields, dict) else {}
            name, path = fields.get("name"), fields.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(
                f"--lora-modules takes NAME=PATH or JSON with name and path, got {spec!r}"
            )
        adapters.append(LoRARequest(name, lora_id, path))
    return tuple(adapters)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="vLLM's: a file of flags (max_num_seqs: 128 or max-num-seqs: 128); the flags given "
        "on the command line win (config_file.py)",
    )


def add_off_switch(parser: argparse.ArgumentParser, flag: str, dest: str, help: str) -> None:
    """A flag that sets `dest` False, beside the flag that sets it True: the last given wins, and
    without either `dest` keeps that flag's default."""
    parser.add_argument(flag, dest=dest, action="store_false", default=argparse.SUPPRESS, help=help)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from tandem.server.options import FINGERPRINT_MODES, LOG_LEVELS, ServerOptions
    from tandem.server.tool_calls import PARSERS
    from tandem.tokenizer import CONTENT_FORMATS

    defaults = ServerOptions()
    parser.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (0.0.0.0: every interface, as vLLM)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key",
        nargs="+",
        help="require 'Authorization: Bearer KEY' with one of these keys (not on /health, /ping "
        "and /metrics; default: $VLLM_API_KEY, as vLLM, else none)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model names clients may send, answers carrying the first (default: MODEL)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        help="LoRA adapters served as models: NAME=PATH (a PEFT folder) each; needs --enable-lora",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true)",
    )
    parser.add_argument(
        "--server-dev-mode",
        action="store_true",
        help="serve vLLM's development routes: POST /collective_rpc, which runs any engine or "
        "worker extension method by name, GET /server_info (the engine's settings and the "
        "machine's software), POST /reset_mm_cache and /reset_encoder_cache (also on with "
        "vLLM's VLLM_SERVER_DEV_MODE=1 or true)",
    )
    parser.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's settings (its tokenizer_config.json, "
        "added tokens by id) and the chat template, which a client may render prompts with",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.max_request_bytes,
        help="a larger request body is a 413",
    )
    parser.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=defaults.max_sequences_per_request,
        help="prompts x n one request may start; more is a 400",
    )
    parser.add_argument(
        "--max-stop-strings",
        type=int,
        default=defaults.max_stop_strings,
        help="stop strings per request; more is a 400",
    )
    parser.add_argument(
        "--max-stop-string-length",
        type=int,
        default=defaults.max_stop_string_length,
        help="characters per stop string; longer is a 400",
    )
    parser.add_argument(
        "--health-stall-timeout",
        dest="health_stall_timeout_s",
        type=float,
        default=defaults.health_stall_timeout_s,
        metavar="SECONDS",
        help="/health is 503 once the engine has had work this long without finishing a step "
        "(0: never)",
    )
    parser.add_argument(
        "--drain-timeout",
        "--shutdown-timeout",
        dest="drain_timeout_s",
        type=float,
        default=defaults.drain_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM, how long open requests may go on before they are ended "
        "(--shutdown-timeout: vLLM's name)",
    )
    parser.add_argument(
        "--access-log", action="store_true", help="log a line per request (off: the GIL is busy)"
    )
    add_off_switch(  # vLLM logs them unless told not to
        parser,
        "--disable-uvicorn-access-log",
        "access_log",
        "vLLM's: no line per request (tandem's default; --access-log turns them on)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=list(PARSERS),
        help="the model's tool-call format, parsed for tool_choice 'auto' (default: none; "
        "'auto' is then a 400)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag for tool_choice 'auto'; needs --tool-call-parser, which alone enables it",
    )
    parser.add_argument(
        "--chat-template",
        type=chat_template,
        help="the chat template of every chat request: a Jinja file, or the template itself "
        "(default: the model's)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat with the template its request sends (chat_template); refused without",
    )
    for name, what in (("origins", "origins"), ("methods", "methods"), ("headers", "headers")):
        parser.add_argument(
            f"--allowed-{name}",
            type=json_strings,
            default=list(getattr(defaults, f"allowed_{name}")),
            help=f"CORS: the allowed {what}, a JSON list",
        )
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--root-path", help="the path prefix of a proxy in front of the server")
    parser.add_argument(
        "--disable-fastapi-docs", action="store_true", help="serve no /docs, /redoc, /openapi.json"
    )
    parser.add_argument("--ssl-keyfile", help="TLS: the private key (PEM) of --ssl-certfile")
    parser.add_argument("--ssl-certfile", help="TLS: the certificate chain (PEM): serve https")
    parser.add_argument("--ssl-ca-certs", help="TLS: CA certificates to verify clients with")
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=defaults.ssl_cert_reqs,
        help="TLS: client certificates, 0 not asked, 1 optional, 2 required",
    )
    parser.add_argument(
        "--ssl-ciphers",
        help="TLS 1.2 and below: the cipher suites, in OpenSSL's list format "
        "(default: uvicorn's, 'TLSv1')",
    )
    parser.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="read the certificate files again when they change (new connections get them)",
    )
    parser.add_argument(
        "--uds", metavar="PATH", help="serve on this Unix socket instead of --host and --port"
    )
    parser.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=defaults.h11_max_incomplete_event_size,
        metavar="BYTES",
        help="a request whose headers are larger is a 431",
    )
    parser.add_argument(
        "--h11-max-header-count",
        type=int,
        default=defaults.h11_max_header_count,
        help="a request with more headers is a 431",
    )
    parser.add_argument(
        "--disable-access-log-for-endpoints",
        metavar="PATHS",
        help="comma-separated paths the access log leaves out, e.g. /health,/metrics",
    )
    parser.add_argument(
        "--log-error-stack",
        action="store_true",
        help="log each error answer's exception with its stack trace (on with "
        "VLLM_SERVER_DEV_MODE too)",
    )
    parser.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="an answer of one choice carries its timings (metrics: queue, first token, "
        "generation and inter-token ms, tokens per second); a stream's on its usage chunk",
    )
    parser.add_argument(
        "--fingerprint-mode",
        choices=FINGERPRINT_MODES,
        default=defaults.fingerprint_mode,
        help="the answers' system_fingerprint: full (tandem's version, parallel sizes and a hash "
        "of the engine's settings), hash (no sizes), custom (--fingerprint-value), none (null)",
    )
    parser.add_argument("--fingerprint-value", help="the fingerprint of --fingerprint-mode custom")
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='a chat with tool_choice "none" is rendered without its tools',
    )
    parser.add_argument(
        "--uvicorn-log-level", choices=LOG_LEVELS, help="uvicorn's log level (default: info)"
    )
    parser.add_argument(
        "--log-config-file", metavar="JSON", help="uvicorn's logging config (dictConfig's) file"
    )
    parser.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="PATH",
        help="an ASGI middleware class or async function (request, call_next) by import path, "
        "e.g. mypackage.auth.Middleware, outside the server's own (again for more)",
    )
    add_answer_args(parser)
    add_off_switch(
        parser,
        "--disable-log-requests",
        "enable_log_requests",
        "vLLM's older flag: log no generation requests (the default)",
    )
    parser.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="vLLM's: taken; GET /load always counts the generation calls being answered",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id: the client's own, else a new one",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="every request's logprobs name tokens as 'token_id:<id>'",
    )
    parser.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default=defaults.chat_template_content_format,
        help="how the chat template takes a message's content: a string, or OpenAI's list of "
        "text parts; auto: a list where the template loops over it",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        help="chat template variables as JSON, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override them",
    )


def add_answer_args(parser: argparse.ArgumentParser) -> None:
    """The flags of how requests are answered and logged, serve's and run-batch's (vLLM's)."""
    from tandem.server.options import ServerOptions

    parser.add_argument(
        "--response-role",
        default=ServerOptions.response_role,
        help="the role of a chat answer after a generation prompt",
    )
    parser.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each generation request: its prompt, prompt ids and sampling parameters",
    )
    parser.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="with --enable-log-requests: log each finished choice's text, ids and finish reason",
    )
    parser.add_argument(
        "--enable-log-deltas",
        action=argparse.BooleanOptionalAction,
        default=ServerOptions.enable_log_deltas,
        help="with --enable-log-outputs, a line for each of a stream's outputs too",
    )
    parser.add_argument(
        "--max-log-len",
        type=int,
        help="--enable-log-requests: the prompt's first that many characters and ids (default: all)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="vLLM's: taken; every usage carries prompt_tokens_details (cached_tokens, "
        "created_cache_tokens)",
    )
    parser.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with a usage chunk, asked for or not (answers that are no "
        "stream always carry it)",
    )


def json_strings(value: str) -> list[str]:
    """An argparse type: a JSON list of strings."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself where it reads as a template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in value for mark in ("{%", "{{", "\n")):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template")


def check_data_parallel_size(size: int) -> None:
    """--data-parallel-size: at least 1, and past 1 only with Ray installed."""
    if size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {size}")
    if size > 1 and importlib.util.find_spec("ray") is None:
        raise ValueError("--data-parallel-size above 1 runs on Ray: pip install 'tandem[ray]'")


def cmd_run_batch(args: argparse.Namespace) -> None:
    from tandem.run_batch import run_batch

    check_local_file("--input-file", args.input_file)
    check_local_file("--output-file", args.output_file)
    check_output_path("--output-file", args.output_file)
    check_data_parallel_size(args.data_parallel_size)
    options = answer_options(args)
    options.validate()
    if options.enable_log_requests:  # serving's lines, which uvicorn prints under `serve`
        log_requests_to_stderr()
    summary = run_batch(
        args.input_file,
        args.output_file,
        args.model,
        engine_kwargs(args),
        args.data_parallel_size,
        args.served_model_name,
        args.quiet,
        options,
        metrics_address(args),
    )
    # on stderr: the output may be stdout (-o /dev/stdout), whose lines stay JSON
    print(f"{args.output_file}: {summary}", file=sys.stderr)


def check_local_file(flag: str, path: str) -> None:
    """vLLM's run-batch also reads an http(s) input and uploads its output to one; tandem's
    reads and writes local files alone."""
    if path.startswith(("http://", "https://")):
        raise ValueError(
            f"{flag} {path}: tandem's run-batch reads and writes local files, not URLs; "
            "download the input or upload the output with another tool"
        )


def answer_options(args: argparse.Namespace) -> ServerOptions:
    """The ServerOptions run-batch's flags set (add_answer_args), the rest ServerOptions'."""
    from tandem.server.options import ServerOptions

    names = ("response_role", "enable_log_requests", "enable_log_outputs", "max_log_len",
             "enable_force_include_usage")  # fmt: skip
    return ServerOptions(**{name: getattr(args, name) for name in names})


def log_requests_to_stderr() -> None:
    import logging

    from tandem.server.serving import logger

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def metrics_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """run-batch's (host, port) of --enable-metrics, vLLM's defaults 0.0.0.0 and 8000."""
    if not args.enable_metrics:
        given = [flag for flag in ("url", "port") if getattr(args, flag) is not None]
        if given:
            flags = " and ".join(f"--{flag}" for flag in given)
            raise ValueError(f"{flags}: where --enable-metrics serves; give it too")
        return None
    port = 8000 if args.port is None else args.port
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port is in 0-65535")
    return (args.url or "0.0.0.0", port)


# tiny.ARCH_CONFIGS' keys (tiny.py is not imported before a command needs it)
TINY_ARCHS = ["gemma2", "gemma3", "llama", "mistral", "mistral_sliding", "mixtral", "phi3", "qwen2",
              "qwen2_moe", "qwen3", "qwen3_moe"]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from tandem import __version__

    parser = Parser(prog="tandem", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser(
        "make-tiny-model", help="write a small random checkpoint in Hugging Face format"
    )
    tiny.add_argument("out_dir", help="the folder to write")
    tiny.add_argument(
        "--arch", choices=TINY_ARCHS, default="llama", help="architecture of the checkpoint"
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.set_defaults(func=cmd_make_tiny_model)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    add_sampling_args(gen)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.add_argument("--trace", metavar="PATH", help="record a CPU/GPU timeline to this JSON")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="chat on stdin: with MODEL, loaded here; without, with a running server (vLLM's)",
    )
    add_engine_args(chat, model_flag="optional")
    add_sampling_args(chat)
    chat.add_argument(
        "--system", "--system-prompt", default=None, help="a system message to start with"
    )
    chat.add_argument("-q", "--quick", metavar="MESSAGE", help="answer this one message, then exit")
    add_client_args(chat)
    chat.set_defaults(func=cmd_chat)

    complete = sub.add_parser(
        "complete", help="complete each prompt on stdin with a running server (vLLM's)"
    )
    add_client_args(complete)
    complete.add_argument("--max-tokens", type=int, help="the most tokens of each completion")
    complete.add_argument(
        "-q", "--quick", metavar="PROMPT", help="complete this one prompt, then exit"
    )
    complete.set_defaults(func=cmd_complete)

    collect_env = sub.add_parser(
        "collect-env", help="the machine's software and GPUs, for a bug report (vLLM's)"
    )
    collect_env.set_defaults(func=cmd_collect_env)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve, model_flag="either")
    add_config_flag(serve)
    add_serve_args(serve)
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas behind the endpoint, on Ray Serve (needs tandem[ray])",
    )
    serve.set_defaults(func=cmd_serve)

    run_batch = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL)")
    add_engine_args(run_batch, model_flag="either")
    add_config_flag(run_batch)
    run_batch.add_argument("-i", "--input-file", required=True, help="requests (JSONL)")
    run_batch.add_argument(
        "-o", "--output-file", required=True, help="results (JSONL); an existing one is resumed"
    )
    run_batch.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas on Ray, tensor-parallel-size GPUs each (needs tandem[ray])",
    )
    run_batch.add_argument(
        "--output-tmp-dir",
        metavar="DIR",
        help="vLLM's: where an output URL's file is written before its upload; tandem writes "
        "a local --output-file only, so this is accepted and unused (as vLLM's for a file)",
    )
    run_batch.add_argument(
        "--served-model-name",
        nargs="+",
        help="the model names requests may give, answers carrying the first (default: MODEL)",
    )
    add_answer_args(run_batch)
    run_batch.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve the engine's Prometheus metrics over HTTP at --url:--port while it runs",
    )
    run_batch.add_argument(
        "--url", help="--enable-metrics: the address the metrics are served on (default: 0.0.0.0)"
    )
    run_batch.add_argument(
        "--port", type=int, help="--enable-metrics: the port of the metrics (default: 8000)"
    )
    run_batch.add_argument("--quiet", action="store_true", help="no progress bar")
    run_batch.set_defaults(func=cmd_run_batch)
    bench = sub.add_parser(
        "bench", help="benchmarks: throughput, latency, serve, startup"
    ).add_subparsers(dest="mode", required=True, metavar="MODE")
    from tandem.bench import add_bench_args

    throughput = bench.add_parser(
        "throughput", help="offline throughput: every request submitted at once"
    )
    add_engine_args(throughput, model_flag="option")
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
    add_engine_args(latency, model_flag="option")
    add_bench_args(latency, latency=True)
    latency.set_defaults(func=cmd_bench)
    startup = bench.add_parser(
        "startup", help="how long an engine takes to start, with the compile caches empty and full"
    )
    add_engine_args(startup, model_flag="option")
    from tandem.bench_startup import add_startup_args

    add_startup_args(startup)
    startup.set_defaults(func=cmd_bench_startup)

    trace = sub.add_parser("trace", help="read a Chrome trace written with --trace")
    actions = trace.add_subparsers(dest="action", required=True, metavar="ACTION")
    summarize = actions.add_parser("summarize", help="GPU-active %%, idle gaps, CPU phase times")
    summarize.add_argument("path", help="a trace written with --trace")
    summarize.add_argument("--json", action="store_true", help="print the summary dict as JSON")
    summarize.set_defaults(func=cmd_trace_summarize)
    plot = actions.add_parser("plot", help="PNG: whole-run GPU busy vs idle, a few steps zoomed")
    plot.add_argument("path", help="a trace written with --trace")
    plot.add_argument("-o", "--output", required=True, metavar="PNG", help="the image to write")
    plot.add_argument("--window-steps", type=int, default=6, help="steps in the zoomed window")
    plot.set_defaults(func=cmd_trace_plot)
    return parser


def resolve_model(args: argparse.Namespace) -> None:
    """One model from `MODEL` or `--model MODEL`: one of them, or both the same."""
    if "model_option" not in args:
        return
    given = {name for name in (args.model, args.model_option) if name is not None}
    if len(given) != 1:
        args.command_parser.error(
            "the following arguments are required: model (MODEL or --model MODEL)"
            if not given
            else f"two models given: {args.model!r} and --model {args.model_option!r}"
        )
    args.model = given.pop()


def subcommand(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The parser of the command argv[0] names (None: no such command; argparse says so)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv:
            return action.choices.get(argv[0])
    return None


SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """vLLM's lengths: an int, or a number with a suffix (k, m, g: powers of 1000; K, M, G:
    of 1024), e.g. "25.6k" -> 25600, "1K" -> 1024."""
    number, unit = (text[:-1], SUFFIXES[text[-1]]) if text[-1:] in SUFFIXES else (text, 1)
    try:
        value = decimal.Decimal(number) * unit
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(
            f"not a length: {text!r} (e.g. 4096, 32k or 32K)"
        ) from None
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is no whole number of tokens")
    return int(value)


def max_model_len(text: str) -> int:
    """--max-model-len: a length as `human_int` takes it, or vLLM's "auto" / -1 (-1: the longest
    the KV cache holds, the model's at most)."""
    if text.strip().lower() in ("auto", "-1"):
        return FIT_TO_CACHE
    return human_int(text)


def dashed(arg: str) -> str:
    """A flag spelt with underscores as argparse knows it, as vLLM's parser takes it:
    --max_num_seqs=8 -> --max-num-seqs=8; values and short flags stay as they are."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def main(argv: list[str] | None = None) -> None:
    try:
        envs.check_all()  # before the parser imports the modules that read them
    except ValueError as error:
        sys.exit(f"tandem: error: {error}")
    parser = build_parser()
    argv = [dashed(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    command = subcommand(parser, argv)
    if command is not None and "--config" in command._option_string_actions:
        try:
            argv = config_file.expand(argv, command)
        except (ValueError, OSError) as error:
            sys.exit(f"tandem: error: {error}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command they were given to, with its usage
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    resolve_model(args)
    try:
        args.func(args)
    except (ValueError, OSError) as error:
        sys.exit(f"tandem: error: {error}")


if __name__ == "__main__":
    main()
