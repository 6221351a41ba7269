"""`tandem bench serve`: many concurrent streaming completions against a running server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from tandem.workload import at_least, fraction

# /tokenize turns this into the token ids random prompts are drawn from, so every id is valid
SAMPLE_TEXT = (
    "The CPU prepares the next batch while the GPU computes the current one; continuous "
    "batching admits and retires requests every step over a paged key-value cache. 0123456789"
)
PERCENTILES = (50, 90, 99)
# --backend -> its default endpoint (vLLM's names)
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    end: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # seconds between consecutive token chunks

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2:
            return None
        return (self.end - self.start - self.ttft) / (self.num_output_tokens - 1)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", help="the server (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    parser.add_argument("--port", type=int, default=8000, help="the server's port, likewise")
    parser.add_argument(
        "--backend",
        choices=tuple(ENDPOINTS),
        default="openai",
        help="vLLM's: openai sends completions of the token-id prompts, openai-chat sends "
        "each prompt's text as a user message",
    )
    parser.add_argument("--endpoint", help="the path (default: the backend's /v1/... path)")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: none)")
    parser.add_argument("--num-prompts", type=at_least(1), default=200, help="requests to send")
    parser.add_argument(
        "--max-concurrency", type=at_least(1), help="requests in flight at once (default: all)"
    )
    parser.add_argument(
        "--request-rate",
        type=positive_rate,
        default=math.inf,
        help="requests sent per second on average, their gaps drawn as --burstiness says "
        "(inf: all at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=positive_rate,
        default=1.0,
        help="the gaps' gamma shape: 1 Poisson arrivals, below 1 burstier, above steadier",
    )
    # vLLM's --random-* names too
    parser.add_argument(
        "--input-len", "--random-input-len", type=at_least(1), default=128, help="prompt tokens"
    )
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        type=at_least(1),
        default=128,
        help="new tokens per request",
    )
    parser.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=fraction,
        default=0.0,
        help="lengths uniform in [len x (1 - r), len x (1 + r)]",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--output-json", help="write the report here (default: none)")
    # vLLM's way to save the report
    parser.add_argument(
        "--save-result",
        action="store_true",
        help="write the report to --result-dir/--result-filename (unnamed: "
        "LABEL-RATEqps[-concurrencyN]-MODEL-DATETIME.json in the working folder)",
    )
    parser.add_argument("--result-dir", help="the folder of --save-result's file (made if new)")
    parser.add_argument("--result-filename", help="the name of --save-result's file")
    parser.add_argument("--label", default="tandem", help="the start of --save-result's name")


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from tandem.cli import check_output_path

    check_output_path("--output-json", args.output_json)
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise ValueError("--result-dir and --result-filename name --save-result's file: add it")
    report = asyncio.run(run_bench(args))
    print_report(report)
    paths = [args.output_json] if args.output_json else []
    if args.save_result:
        paths.append(result_path(args, report["model"], time.strftime("%Y%m%d-%H%M%S")))
    for path in paths:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def result_path(args: argparse.Namespace, model: str, when: str) -> str:
    """--save-result's file, named as vLLM's benchmark names it unless --result-filename."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (
        f"{args.label}-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{when}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        return os.path.join(args.result_dir, name)
    return name


def positive_rate(text: str) -> float:
    """An argparse type: a number above 0 ("inf" too)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def arrival_times(args: argparse.Namespace) -> list[float]:
    """Seconds from the start at which each request is sent, as vLLM's benchmark spaces them:
    all at 0 at an infinite --request-rate, else the first at 0 and each next after a gap drawn
    from a gamma distribution of mean 1 / rate and shape --burstiness (1: a Poisson process)."""
    if math.isinf(args.request_rate):
        return [0.0] * args.num_prompts
    rng = np.random.default_rng([args.seed, 1])  # a stream apart from the prompts'
    scale = 1.0 / (args.request_rate * args.burstiness)
    gaps = rng.gamma(args.burstiness, scale, size=args.num_prompts - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


async def run_bench(args: argparse.Namespace) -> dict:
    import httpx  # only this command needs an HTTP client

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    concurrency = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=None, limits=limits
    ) as client:
        model = args.model or (await checked(client.get("/v1/models")))["data"][0]["id"]
        vocabulary = sorted(
            set((await checked(client.post("/tokenize", json={"prompt": SAMPLE_TEXT})))["tokens"])
        )
        prompts, output_lens = random_requests(args, vocabulary)
        endpoint = args.endpoint or ENDPOINTS[args.backend]
        if args.backend == "openai-chat":  # the prompts' text, as the chat's user messages
            texts = await asyncio.gather(*(
                checked(client.post("/detokenize", json={"tokens": p})) for p in prompts
            ))  # fmt: skip
            prompts = [t["prompt"] for t in texts]
        slots = asyncio.Semaphore(concurrency)
        start = time.perf_counter()

        async def limited(
            prompt: list[int] | str, max_tokens: int, seed: int, at: float
        ) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))  # its arrival
            async with slots:
                return await stream_completion(
                    client, endpoint, model, prompt, max_tokens, args.temperature, seed
                )

        requests = zip(prompts, output_lens, arrival_times(args), strict=True)
        results = await asyncio.gather(
            *(limited(p, n, args.seed + i, at) for i, (p, n, at) in enumerate(requests))
        )
        duration = time.perf_counter() - start
    return summarize(results, duration, model, args, base_url)


def random_requests(
    args: argparse.Namespace, vocabulary: list[int]
) -> tuple[list[list[int]], list[int]]:
    """Token-id prompts and output lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    rng = np.random.default_rng(args.seed)

    def lengths(n: int) -> list[int]:
        low, high = (
            max(1, round(n * (1 - args.range_ratio))),
            max(1, round(n * (1 + args.range_ratio))),
        )
        return rng.integers(low, high + 1, size=args.num_prompts).tolist()

    prompts = [rng.choice(vocabulary, size=n).tolist() for n in lengths(args.input_len)]
    return prompts, lengths(args.output_len)


async def stream_completion(
    client,
    endpoint: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    temperature: float,
    seed: int,
) -> RequestResult:
    """One streamed request: a completion of token ids, or (a text prompt) a chat's user
    message; its prompt tokens as the server counted them."""
    chat = isinstance(prompt, str)
    body = {
        "model": model,
        **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # a chunk per token, even while text is held back
    }
    result = RequestResult(start=time.perf_counter())
    last = result.start
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk["choices"] and carries_tokens(chunk["choices"][0]):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as error:  # a benchmark counts failures instead of stopping at the first
        result.error = repr(error)
        return result
    result.end = last
    result.ok = result.num_output_tokens == max_tokens
    if not result.ok:
        result.error = f"got {result.num_output_tokens} of {max_tokens} tokens"
    return result


def carries_tokens(choice: dict) -> bool:
    """Whether a streamed choice brings tokens (a chat's first chunk may bring its role alone,
    its last the finish reason alone)."""
    return bool(choice.get("token_ids") or choice.get("text") or
                (choice.get("delta") or {}).get("content"))  # fmt: skip


def summarize(
    results: list[RequestResult],
    duration: float,
    model: str,
    args: argparse.Namespace,
    base_url: str,
) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)

    def stats_ms(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        ms = np.asarray(values) * 1000
        return {"mean": float(ms.mean())} | {
            f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES
        }

    return {
        "model": model,
        "base_url": base_url,
        "backend": args.backend,
        "request_rate": args.request_rate,  # inf: all at once
        "burstiness": args.burstiness,
        "send_times_s": [r.start - results[0].start for r in results] if results else [],
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "max_concurrency": args.max_concurrency or args.num_prompts,
        "duration_s": duration,
        "requests_per_s": len(done) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / duration,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([x for r in done for x in r.itl]),
        "e2e_ms": stats_ms([r.end - r.start for r in done]),
    }


def print_report(report: dict) -> None:
    rate = report["request_rate"]
    arrivals = "all at once" if math.isinf(rate) else f"{rate:g} req/s sent"
    print(
        f"completed {report['completed']}/{report['num_prompts']} requests "
        f"({report['failed']} failed) in {report['duration_s']:.2f} s, "
        f"concurrency {report['max_concurrency']}, {arrivals}"
    )
    for error in report["errors"]:
        print(f"  error: {error}")
    print(
        f"{report['requests_per_s']:.2f} req/s, {report['output_tokens_per_s']:.0f} output tok/s, "
        f"{report['total_tokens_per_s']:.0f} total tok/s"
    )
    print(f"{'ms':6} {'mean':>9} " + " ".join(f"{f'p{p}':>9}" for p in PERCENTILES))
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = report[f"{name}_ms"]
        if stats:
            values = " ".join(f"{stats[f'p{p}']:9.2f}" for p in PERCENTILES)
            print(f"{name.upper():6} {stats['mean']:9.2f} {values}")


async def checked(response_awaitable) -> dict:
    response = await response_awaitable
    response.raise_for_status()
    return response.json()
