"""The step loop: schedule, build, launch, read back, process, with or without overlap."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from tandem import generation_config, hub, penalties, piecewise, scoring, structured
from tandem.admission import Admission
from tandem.attention import get_backend, rows_per_shared_group
from tandem.batch import BatchBuilder, StepBatch, StepFailed
from tandem.batch_invariant import invariant_attention, make_batch_invariant
from tandem.compilation import graph_plan
from tandem.config import FIT_TO_CACHE, EngineConfig, ModelConfig, cdiv
from tandem.io_slot import check_logprobs_width
from tandem.kv_cache import BlockAllocator, allocate_kv_cache, bytes_per_block
from tandem.logits_processors import LogitsProcessors
from tandem.lora.adapters import AdapterCache, AdapterSlots, read_adapter
from tandem.memory import num_kv_blocks
from tandem.metrics import EngineStats, RequestCounts, StatLogger
from tandem.model.loader import build_model, read_hf_config
from tandem.model.lora import LoRALayers
from tandem.parallel import (
    TensorParallel,
    check_shardable,
    free_port,
    init_process_group,
    leave_process_group,
    rank0_check,
)
from tandem.pooling import ModelPooling
from tandem.pooling import has_rows as has_pooled_rows
from tandem.pooling import store as store_embeddings
from tandem.profiler import NoTimeline, Timeline
from tandem.prompt_embeds import has_rows as has_embed_rows
from tandem.prompt_logprobs import has_rows as has_prompt_logprob_rows
from tandem.prompt_logprobs import store as store_prompt_logprobs
from tandem.reasoning import ThinkTokens
from tandem.repetition import ends_in_repetition
from tandem.request import Request
from tandem.roofline import step_work
from tandem.rpc import apply_to_model, check_call, pickled, run_call, worker_extension
from tandem.runner import Runner, graph_batch_sizes
from tandem.sampling import SamplingParams
from tandem.scheduler import Scheduler
from tandem.sleep import LEVELS, PARTS, DeviceMemory
from tandem.structured import accept
from tandem.swap import SwapManager, Swapper, check_swap_space
from tandem.token_logprobs import entry as token_logprob_entry
from tandem.tokenizer import Tokenizer
from tandem.torch_profile import Profile
from tandem.weight_transfer import WeightReceiver, make_receiver
from tandem.weights import (
    NamedTensors,
    apply_update,
    check_named_tensors,
    plan_update,
    read_checkpoint,
)
from tandem.workers import Workers

logger = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "abort", "wait")  # pause_generation's: vLLM's names
SHUT_DOWN = "this engine was shut down"  # what a shut engine answers every call that needs it


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, PAUSE_MODES))}, got {mode!r}")


class Engine:
    """Continuous batching over a paged KV cache.

    With `async_batching`, step N+1 is scheduled, built and launched before step N's sampled
    tokens are read: a request in both steps gets a placeholder plus a carry-over index, and
    the device substitutes step N's token. Without it, each step is read back before the next
    is built. Both modes run the same functions; only the moment of `_process` differs.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, port: int | None = None):
        started = time.perf_counter()
        config.validate()
        self.config = config
        hf_config, folder = read_hf_config(
            config.model,
            hub.Source(config.revision, config.download_dir, config.hf_token),
            weights=config.load_format != "dummy",
            overrides=config.hf_overrides,
        )
        self.model_config = cfg = ModelConfig.from_hf(hf_config)
        check_shardable(cfg, config.tensor_parallel_size)
        self.tp = TensorParallel(rank, config.tensor_parallel_size)
        self.device = config.resolve_device(rank)
        self.workers: Workers | None = None
        self.commands: list[tuple] = []  # for the other ranks, sent with the next step
        self.closed = False  # shutdown ran: a second call does nothing, a step raises
        # vLLM's worker_extension_cls: its object, whose methods collective_rpc may name (rpc.py)
        self.worker_extension = worker_extension(self, config.worker_extension_cls)
        # what the step wait calls while it polls (tensor parallelism): are the other ranks alive?
        self.check_ranks: Callable[[], None] | None = None
        if self.tp.size > 1:
            if rank == 0:
                port = free_port()
                self.workers = Workers(config, port)
                self.check_ranks = self.workers.check
            else:
                self.check_ranks = rank0_check()
        try:
            self._start(config, cfg, hf_config, folder, rank, port, started)
        except BaseException:
            if self.workers is not None:
                self._abandon_workers()
            raise

    def _abandon_workers(self) -> None:
        """Rank 0 failed while starting: name a rank that died (the likely cause), end them all."""
        try:
            self.workers.check()
        finally:
            self.workers.kill()
            self.workers = None
            if self.device.type != "cuda":  # an NCCL group with a lost rank cannot be left
                leave_process_group()

    def _start(
        self,
        config: EngineConfig,
        cfg: ModelConfig,
        hf_config: dict,
        folder: Path | None,
        rank: int,
        port: int | None,
        started: float,  # perf_counter when __init__ began
    ) -> None:
        self.dtype = config.resolve_dtype(cfg, self.device)
        self.max_model_len = config.resolve_max_model_len(cfg)
        self.model_folder = folder  # the checkpoint's (None: a preset): reload_weights reads it
        tokenizer_dir = None if config.skip_tokenizer_init else hub.tokenizer_folder(config, folder)
        found = tokenizer_dir and (tokenizer_dir / "tokenizer.json").is_file()
        named = config.tokenizer or config.model  # as the caller named it (a Hub id, say)
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir, named) if found else None
        self.eos_token_ids = _eos_token_ids(cfg, folder, self.tokenizer)
        self.primary_eos_token_id = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self.model_pooling = ModelPooling.of(folder, hf_config, cfg.num_labels)
        # a classifier's label names, by index (config.json's id2label; else LABEL_i)
        id2label = hf_config.get("id2label") or {}
        self.class_labels = [id2label.get(str(i), f"LABEL_{i}") for i in range(cfg.num_labels)]
        # a cross-encoder's pair prompt: the tokenizer's pair encoding, else the texts joined
        self.separates_pairs = scoring.separates_pairs(hf_config)
        # SamplingParams fields in place of its own defaults (LLM.generate without params, and
        # the server's requests that leave them out)
        self.sampling_defaults = generation_config.sampling_defaults(
            folder, config.generation_config, config.override_generation_config
        )
        # the most top ids a position's logprobs return: the width of the slots' buffers
        self.logprobs_width = config.logprobs_width(cfg.vocab_size)
        check_logprobs_width(
            self.logprobs_width,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_logprobs,
        )
        self.model = build_model(
            cfg,
            hf_config,
            folder,
            config.load_format,
            self.dtype,
            self.device,
            self.max_model_len,
            config.seed,
            self.tp,
            config.quantization,
            fp8_kv_cache=config.kv_cache_dtype != "auto",
        )
        loaded = self._device_time()
        if self.tp.size > 1:  # after the rank-local start-up: a rank dying there raises here
            init_process_group(rank, self.tp.size, port, self.device, self.check_ranks)
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(self.dtype)
        if config.deterministic:
            make_batch_invariant(self.model)
        # vLLM's `model.load_weights`, as `apply_model` hands the model over: through this
        # engine's update (weak: the model keeps no engine alive)
        self.model.weight_loader = weakref.WeakMethod(self.update_weights)
        # LoRA adapters: their device slots (before the KV cache takes what memory is left), and
        # the adapters read from disk as requests name them
        self.adapter_cache: AdapterCache | None = None
        adapter_slots = None
        if config.enable_lora:
            self.model.lora = LoRALayers(
                self.model, config.max_loras, config.max_lora_rank, config.max_num_batched_tokens
            )
            read = functools.partial(
                read_adapter, shapes=self.model.lora.shapes(), max_rank=config.max_lora_rank,
                full_cfg=cfg, tp=self.tp, dtype=self.dtype, pin=self.device.type == "cuda",
                source=hub.Source(None, config.download_dir, config.hf_token),
            )  # fmt: skip
            self.adapter_cache = AdapterCache(read, config.max_cpu_loras or config.max_loras)
            adapter_slots = AdapterSlots(config.max_loras, self.adapter_cache)
        local = self.model.cfg  # this rank's heads and MLP slice
        self.attention_backend = config.resolve_attention_backend(cfg, self.device)
        self.attend = get_backend(
            self.attention_backend,
            local.num_heads,
            local.num_kv_heads,
            local.head_dim,
            config.max_num_seqs,
            self.device,
        )
        # before the KV cache is sized from what is left
        self.penalties = penalties.PenaltyState(
            config.max_num_seqs, cfg.vocab_size, config.max_num_batched_tokens, self.device
        )
        self.logits_processors = (  # custom ones, vLLM's (logits_processors.py)
            LogitsProcessors(config.logits_processors, config, self.device)
            if config.logits_processors
            else None
        )
        if config.deterministic:
            self.attend = invariant_attention(self.attention_backend, self.attend)
        num_blocks = num_kv_blocks(
            config,
            local,
            self.kv_cache_dtype,
            self.device,
            self.max_model_len,
            self.model,
            self.attend,
        )
        self.num_blocks = self.tp.min(num_blocks, self.device)  # every rank schedules alike
        if config.max_model_len == FIT_TO_CACHE:  # vLLM's -1: the longest the cache holds
            self.max_model_len = min(self.max_model_len, self.num_blocks * config.block_size)
            logger.info("max_model_len fitted to the KV cache: %d", self.max_model_len)
        self.model_config = cfg = replace(
            cfg, max_model_len=self.max_model_len, model=config.model, dtype=self.dtype
        )
        self.block_size = config.block_size
        max_blocks_per_seq = cdiv(self.max_model_len, config.block_size)
        self.kv_caches = allocate_kv_cache(
            local, self.num_blocks, config.block_size, self.kv_cache_dtype, self.device
        )
        self.allocator = BlockAllocator(self.num_blocks)
        max_tokens = config.max_num_batched_tokens
        num_host_blocks = self._num_host_blocks(local, max_blocks_per_seq)
        per_block = bytes_per_block(local, config.block_size, self.dtype)
        swap = SwapManager(
            self.allocator, num_host_blocks, config.preemption_mode, per_block, local
        )
        self.scheduler = Scheduler(
            self.allocator,
            config.block_size,
            config.max_num_seqs,
            max_tokens,
            self.max_model_len,
            config.enable_prefix_caching,
            swap,
            config.scheduling_policy,
            adapter_slots,
        )
        self.swapper = (
            Swapper(self.kv_caches, num_host_blocks, self.device) if num_host_blocks else None
        )
        # the Triton decode reads blocks that rows share once per group (cascade attention);
        # not across sliding windows, whose keys before the window it must not see
        shared_rows = (
            rows_per_shared_group(local.num_heads, local.num_kv_heads)
            if self.attention_backend == "triton"
            and not cfg.sliding_window
            and not config.deterministic
            and not config.disable_cascade_attn
            else 0
        )
        processors = self.logits_processors
        self.builder = BatchBuilder(
            config.block_size,
            config.max_num_seqs,
            max_blocks_per_seq,
            self.eos_token_ids,
            shared_rows,
            self.scheduler.cache.publication,
            custom_logits=processors is not None,
            processors_read_outputs=processors is not None and processors.read_outputs,
        )
        self.runner = Runner(
            self.model,
            self.kv_caches,
            self.attend,
            self.device,
            max_tokens,
            config.max_num_seqs,
            max_blocks_per_seq,
            graph_sizes=self._graph_sizes(),
            tp=self.tp,
            piecewise=self._use_piecewise(),
            cascade=shared_rows > 0,
            penalties=self.penalties,
            swapper=self.swapper,
            # token masks for structured outputs, where the backend and a tokenizer are here
            mask_vocab_size=cfg.vocab_size if self.tokenizer and structured.available() else None,
            logprobs_mode=config.logprobs_mode,
            logits_processors=self.logits_processors,
            prompt_embeds=config.enable_prompt_embeds,
            max_top=self.logprobs_width,
        )
        captured = 0.0  # seconds of kernel compilation and graph capture
        if self.runner.cuda and (self.runner.graph_sizes or self.runner.token_buckets):
            capture_began = self._device_time()
            self.runner.capture_graphs()
            captured = self._device_time() - capture_began
        self.async_batching = config.async_batching
        self.memory = DeviceMemory([p.detach() for p in self.model.parameters()], self.kv_caches[0])
        self.paused = False  # pause_generation: no step until resume_generation
        self.clear_cache_on_pause = False  # the pause's clear_cache, done once paused
        self.scheduling_asleep = False  # sleep(0): no step until wake_up
        self.resume_on_wake = False  # a sleep's own pause (mode "wait"): wake_up resumes
        # <think> / </think> of a reasoning model (reasoning.py), where reasoning_parser says
        self.think_tokens = (
            ThinkTokens.of(config.reasoning_parser, self.tokenizer)
            if config.reasoning_parser
            else None
        )
        self.admission = Admission(
            config, cfg, self.tokenizer, self.eos_token_ids, self.max_model_len, self.num_blocks,
            self.scheduler.cache, self.adapter_cache, self.model_pooling, self.think_tokens,
            self.runner.masks, self.dtype,
        )  # fmt: skip
        # a trainer process's weights (weight_transfer/), where weight_transfer_config asks
        transfer = config.weight_transfer_config
        self.weight_receiver = (
            make_receiver(transfer, self.device, rank, self.tp.size) if transfer else None
        )
        self.in_flight: deque[StepBatch] = deque()
        # finished when queued (nothing to compute: max_tokens=0, one prompt token); the next step
        # returns them
        self.finished_unscheduled: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counts = RequestCounts()  # tokens made and requests finished so far (stats())
        # disable_log_stats=False: a line of stats every few seconds of stepping
        self.stat_logger = None if config.disable_log_stats else StatLogger(time.monotonic())
        profiling = config.profiler_config
        self.profile = None if profiling is None else Profile(profiling, rank, self.device)
        self.num_steps = 0
        self.seed_rng = random.Random(config.seed)
        self.timeline: Timeline | NoTimeline = NoTimeline()
        # (num_seqs, num_tokens, context_tokens, attention_pairs) per launched step, for the
        # roofline; recorded only while a caller holds a list here (the benchmark does)
        self.step_work: list[tuple[int, int, int, int]] | None = None
        # seconds of the start-up: reading the config, tokenizer and checkpoint into device
        # memory, compiling the kernels and capturing the CUDA graphs (0 without them), and all
        # of it
        self.startup_seconds = {
            "load": loaded - started,
            "graph_capture": captured,
            "total": self._device_time() - started,
        }

    def _device_time(self) -> float:
        """perf_counter once the device has done all it was given (start-up alone)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def byte_sizes(self) -> dict[str, int]:
        """Bytes per weight of the layers' matrices and per KV cache value (1 with FP8, about
        half with int4 weights), for the roofline."""
        qkv = self.model.layers[0].self_attn.qkv_proj
        per_weight = getattr(qkv, "bytes_per_weight", None) or qkv.weight.element_size()
        return {"linear_bytes": per_weight, "kv_bytes": self.kv_cache_dtype.itemsize}

    def _num_host_blocks(self, local: ModelConfig, max_blocks_per_seq: int) -> int:
        """Host blocks for preemption by swap (swap.py): swap_space GiB, or no more than every
        sequence's blocks at once; none under preemption_mode='recompute'."""
        config = self.config
        if config.preemption_mode == "recompute":
            return 0
        per_block = bytes_per_block(local, config.block_size, self.dtype)
        most = config.max_num_seqs * max_blocks_per_seq  # every sequence's blocks at once
        wanted = int(min(config.swap_space * 2**30, most * per_block)) // per_block
        check_swap_space(config.swap_space, wanted * per_block)
        return self.tp.min(wanted, self.device)  # every rank schedules alike

    def shutdown(self) -> None:
        """Stop the other ranks' processes (tensor parallelism), leave the process group and give
        back the device memory of the weights and the KV cache (as vLLM's engine process ends)."""
        if self.closed:  # again: must not sync a stuck device or leave a newer engine's group
            return
        self.closed = True
        # on a GPU, a rank that died mid-step leaves this one's collectives waiting forever: then
        # neither a synchronize nor the NCCL group's teardown would return (gloo raises instead)
        whole = self.workers is None or self.workers.alive() or self.device.type != "cuda"
        if whole:
            self.runner.release_graphs()
        if self.workers is not None:
            self.workers.stop()
        if self.tp.size > 1 and whole:
            leave_process_group()  # may wait for the other ranks to leave too
        if self.workers is not None:
            self.workers.join()
            self.workers = None
        if whole:  # the device finished every step (release_graphs synchronized it)
            self.memory.release()

    def start_trace(self) -> None:
        """Record CPU phases and GPU stream intervals of every following step."""
        self.timeline = Timeline(cuda=self.device.type == "cuda")

    def stop_trace(self) -> Timeline:
        timeline, self.timeline = self.timeline, NoTimeline()
        assert isinstance(timeline, Timeline), "start_trace was not called"
        return timeline

    # ---- requests -------------------------------------------------------------------------

    def enqueue(self, request: Request) -> None:
        """Queue a request made by `make_request`; nothing is queued before validation passes."""
        if request.request_id in self.requests:  # two requests made under one id, both queued
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.lora_request is not None:  # its adapter stays read until it finishes
            lora = request.lora_request
            self.adapter_cache.hold(lora.lora_int_id)
            try:  # read again if it left the cache since admission: no step reads a disk
                self.adapter_cache.get(lora)
            except Exception:
                self.adapter_cache.drop(lora.lora_int_id)
                raise
        if request.seed is None:  # drawn here, so a request made but never queued draws nothing
            request.seed = self.seed_rng.getrandbits(63)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        if self.workers is not None:
            params = replace(request.params, seed=request.seed)
            ids, salt = request.prompt_token_ids, request.cache_salt
            add = ("add", request.request_id, params, ids, salt, request.pooling)
            self.commands.append((*add, request.lora_request, request.priority))
        if self.scheduler.num_to_compute(request) == 0:  # max_tokens=0 with a one-token prompt
            self._finish(request, "length")
            self.finished_unscheduled.append(request)

    def make_request(self, request_id: str, params: SamplingParams, *args, **kwargs) -> Request:
        """A checked Request under an id no other request holds, not yet queued (`enqueue`);
        the other arguments are `Admission.request`'s (prompt or its ids, cache_salt, ...)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.logits_processors is not None:
            self.logits_processors.validate(params)
        return self.admission.request(request_id, params, *args, **kwargs)

    def abort(self, request_id: str) -> None:
        if self.workers is not None:
            self.commands.append(("abort", request_id))
        request = self.requests.pop(request_id, None)
        if request is not None and not request.finished:
            self._finish(request, "abort")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> list[Request]:
        """Forget every cached prefix block (blocks held by running requests stay theirs).
        With `reset_running_requests` (vLLM's), the steps in flight are read back and the
        running and swapped requests recompute their KV too. Returns the requests those steps
        updated."""
        if reset_running_requests:
            if self.workers is not None:
                self._on_other_ranks("reset_prefix_cache", True)
            updated = self.drain()
            self._preempt_running()  # the cache emptied too
            return updated
        self.scheduler.cache.reset()
        if self.workers is not None:
            self.commands.append(("reset_prefix_cache",))
        return []

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """This rank's profiler on, between two steps (profiler_config; LLM.start_profile)."""
        if self.profile is None:
            raise RuntimeError(
                "profiling is off: pass profiler_config={'profiler': 'torch', "
                "'torch_profiler_dir': '/an/absolute/dir'} to the engine"
            )
        self.profile.start(profile_prefix)

    def stop_profile(self) -> str | None:
        """This rank's profiler off; the trace file it wrote (torch), or None (cuda)."""
        if self.profile is None:
            raise RuntimeError("profiling is off: no profiler_config was given")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps launched so far, in the trace
        return self.profile.stop()

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now (metrics.py); call it between steps."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            # swapped out (preempted, their KV on the host) wait too, as vLLM counts them
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
            num_blocks=self.num_blocks,
            num_free_blocks=self.allocator.num_free,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.counts.prompt_tokens,
            num_generation_tokens=self.counts.generation_tokens,
            num_finished=dict(self.counts.finished),
            prefix_cache_queries=self.scheduler.cache.num_queried_tokens,
            prefix_cache_hits=self.scheduler.cache.num_hit_tokens,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.in_flight or self.finished_unscheduled)

    # vLLM's worker attributes, as functions run by `collective_rpc` read them
    # (`self.model_runner.model.load_weights(pairs)`, `self.rank`)
    @property
    def model_runner(self) -> Runner:
        """This rank's runner; its `model` is the rank's model."""
        return self.runner

    @property
    def rank(self) -> int:
        """This engine's tensor-parallel rank."""
        return self.tp.rank

    def get_tokenizer(self) -> Tokenizer | None:
        """vLLM's LLMEngine's: the model's tokenizer (None for a model without one)."""
        return self.tokenizer

    # ---- RL hooks: weight updates, pause, sleep (between steps, on every rank) -------------

    def update_weights(self, named_tensors: NamedTensors) -> set[str]:
        """Copy (Hugging Face name, tensor) pairs into the weights in place, then forget the
        prefix cache; returns the names taken. Every name and shape is checked before anything
        is copied (ValueError naming the first bad one). Steps launched before use the old
        weights, later ones the new."""
        pairs = check_named_tensors(named_tensors)
        # the other ranks' tensors go through pipes from host memory; one rank copies none there
        to_others = None
        if self.workers is not None:
            to_others = ("update_weights", [(n, t.detach().cpu()) for n, t in pairs])
        self._update_weights(pairs, to_others)
        return {name for name, _ in pairs}

    def update_weights_from_path(self, path: str | Path) -> None:
        """`update_weights` with every tensor of a checkpoint folder's safetensors files."""
        self._update_weights(read_checkpoint(path), ("update_weights_from_path", str(path)))

    def reload_weights(
        self,
        weights_iterator: NamedTensors | None = None,
        weights_path: str | Path | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        """vLLM's worker method (`collective_rpc("reload_weights", kwargs=...)`): the pairs
        given, else the safetensors of `weights_path`, else those of the model's own folder,
        copied in as `update_weights` copies them."""
        if is_checkpoint_format is not True:
            raise ValueError(
                "is_checkpoint_format must be True: tandem takes weights under the checkpoint's "
                "(Hugging Face) names and layouts"
            )
        if weights_iterator is not None:
            self.update_weights(weights_iterator)
        elif weights_path is not None:
            self.update_weights_from_path(weights_path)
        elif self.model_folder is None:
            raise ValueError(
                "this engine's model is a preset with no checkpoint folder: give weights_path "
                "or weights_iterator"
            )
        else:
            self.update_weights_from_path(self.model_folder)

    def _update_weights(
        self, pairs: list[tuple[str, torch.Tensor]], on_others: tuple | None
    ) -> None:
        self._check_weights_awake()
        copies = plan_update(self.model, self.model_config, self.tp, pairs)  # raises first
        if self.workers is not None:  # the other ranks validate alike: same names and shapes
            self._on_other_ranks(*on_others)
        apply_update(copies, self.runner.compute_stream if self.runner.cuda else None)
        self._forget_cached_kv()

    def _check_open(self) -> None:
        if self.closed:  # its device memory is given back: nothing may run on it
            raise RuntimeError(SHUT_DOWN)

    def _check_weights_awake(self) -> None:
        self._check_open()
        if "weights" in self.memory.asleep:
            raise RuntimeError(
                "the weights have no device memory while asleep; call wake_up() (or "
                "wake_up(['weights'])) first"
            )

    # ---- weights sent by a trainer process (weight_transfer/; vLLM's calls) ----------------

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Join the trainer's process group, every rank; returns once all its members have."""
        info = self._receiver().parse_init(init_info)
        if self.workers is not None:
            self._on_other_ranks("init_weight_transfer_engine", init_info)
        self._receiver().join(info)

    def start_weight_update(self) -> list[Request]:
        """Take no step until `finish_weight_update`; returns the requests that got a token
        or finished in the steps that were in flight."""
        if self._receiver().active:
            raise RuntimeError(
                "start_weight_update was called while a weight update is active; call "
                "finish_weight_update first"
            )
        if self.workers is not None:
            self._on_other_ranks("start_weight_update")
        self.weight_receiver.active = True
        return self.drain()

    def receive_weights(self, update_info: dict) -> None:
        """Receive the tensors `update_info` announces and copy them into the weights. A bad
        name or shape, no start_weight_update or weights asleep raise (on rank 0) once they
        have arrived, and nothing is copied."""
        receiver = self._receiver()
        info = receiver.parse_update(update_info)  # its fields: what the trainer sends
        if self.workers is not None:
            self._on_other_ranks("receive_weights", update_info)
        try:
            receiver.check_active()
            self._check_weights_awake()
            plan_update(self.model, self.model_config, self.tp, receiver.placeholders(info))
        except Exception:
            # whatever refused it, the announced tensors are taken: the trainer's broadcasts
            # complete, and the next update reads its own bytes, not this one's
            receiver.drain(info)
            if self.tp.rank == 0:  # the others check alike: one error, from rank 0
                raise
            return
        stream = self.runner.compute_stream if self.runner.cuda else None
        for pairs in receiver.receive(info, stream):
            copies = plan_update(self.model, self.model_config, self.tp, pairs)
            apply_update(copies, stream, synchronize=False)
        self._forget_cached_kv()

    def finish_weight_update(self) -> None:
        """Step again (unless paused or asleep)."""
        if not self._receiver().active:
            raise RuntimeError("finish_weight_update was called without start_weight_update")
        if self.workers is not None:
            self._on_other_ranks("finish_weight_update")
        self.weight_receiver.active = False

    def _receiver(self) -> WeightReceiver:
        if self.weight_receiver is None:
            raise RuntimeError(
                "weight transfer is not configured: start the engine with "
                'weight_transfer_config={"backend": "nccl"}'
            )
        return self.weight_receiver

    def pause_generation(self, mode: str = "keep", clear_cache: bool = False) -> list[Request]:
        """Stop stepping after the steps in flight are read back. "keep" holds every request and
        its KV until `resume_generation`; "abort" finishes them with finish_reason "abort";
        "wait" (vLLM's) admits nothing new and goes on stepping until the admitted requests
        finish, then pauses (`paused` turns True in that step; the waiting ones stay queued).
        With `clear_cache` (vLLM's), once paused the prefix cache is emptied and the requests
        kept drop their KV to recompute it: weights written meanwhile, by any means, are the
        ones every later token attends over. Returns the requests that got a token or
        finished meanwhile."""
        check_pause_mode(mode)
        if self.workers is not None:
            self._on_other_ranks("pause_generation", mode, clear_cache)
        self.clear_cache_on_pause = clear_cache
        if mode == "wait":
            self.scheduler.admitting = False
            self._pause_once_drained()
            return []
        updated = self.drain()
        if mode == "abort":
            aborted = list(self.requests.values())
            for request in aborted:
                self._finish(request, "abort")
            updated += aborted
        self._paused()
        return updated

    def resume_generation(self, recompute_kv: bool = False) -> list[Request]:
        """Step again; with `recompute_kv`, the steps in flight are read back and the running
        and swapped requests drop their KV (stale after a weight update) to recompute it, as if
        preempted by recompute. Returns the requests those steps updated."""
        if self.workers is not None:
            self._on_other_ranks("resume_generation", recompute_kv)
        updated = []
        if recompute_kv:
            updated = self.drain()
            self._preempt_running()
        self.paused = False
        self.scheduler.admitting = True
        return updated

    @property
    def is_paused(self) -> bool:
        """Paused, or pausing: `pause_generation("wait")` holds new requests (vLLM's)."""
        return self.paused or not self.scheduler.admitting

    def _pause_once_drained(self) -> None:
        """`pause_generation("wait")`'s end: paused once no admitted request is left."""
        if self.scheduler.admitting:  # every step but those of a pause "wait": one read
            return
        if not (self.scheduler.has_started_work() or self.in_flight or self.finished_unscheduled):
            self._paused()

    def _paused(self) -> None:
        self.paused = True
        if self.clear_cache_on_pause:
            self._preempt_running()  # the prefix cache emptied too

    def sleep(self, level: int = 1) -> int:
        """Give back the device memory of the KV cache and the weights (level 1: kept in host
        memory; level 2: dropped, send new ones with `update_weights` after `wake_up`). Running
        and swapped requests recompute their KV after `wake_up`. Level 0 (vLLM's) only holds
        the steps, requests keeping their KV, until `wake_up`. Returns the bytes freed on this
        rank."""
        if level not in (0, *LEVELS):
            raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
        self._check_open()
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep already; call wake_up() first")
        if level == 0:  # the other ranks step only when this one says so: nothing to tell them
            self.drain()
            self.scheduling_asleep = True
            return 0
        if self.workers is not None:
            self._on_other_ranks("sleep", level)
        self.drain()  # tokens in flight are kept (call `drain` first to see who got one)
        self._preempt_running()
        self.runner.reset_graphs()
        freed = self.memory.sleep(level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory of the parts named ("weights", "kv_cache"; None: both) again, the
        same tensors; parts awake already stay as they are. Once both are awake the captured
        graphs are made anew and the engine steps again."""
        if tags is not None and (
            not isinstance(tags, list | tuple | set) or not all(isinstance(t, str) for t in tags)
        ):
            raise TypeError(f"tags must be a list of part names or None, got {tags!r:.80}")
        parts = set(PARTS if tags is None else tags)
        if unknown := sorted(parts - {*PARTS, "scheduling"}):
            raise ValueError(f"unknown tags {unknown}; wake_up takes {[*PARTS, 'scheduling']}")
        self._check_open()
        if parts & self.memory.asleep:
            if self.workers is not None:
                self._on_other_ranks("wake_up", tags)
            self.memory.wake_up(parts & set(PARTS))
            graphs = self.runner.graph_sizes or self.runner.token_buckets
            if not self.memory.asleep and self.runner.cuda and graphs:
                self.runner.capture_graphs()
        if not self.memory.asleep:  # as vLLM: the steps go on once every part is back
            self.scheduling_asleep = False
            if self.resume_on_wake:
                self.resume_on_wake = False
                self.resume_generation()

    @property
    def is_sleeping(self) -> bool:
        """Whether some part has no device memory, or the steps are held by a level 0 sleep
        (vLLM's: until every part woke)."""
        return bool(self.memory.asleep) or self.scheduling_asleep

    @property
    def hold(self) -> str | None:
        """Why no step may run now (shut down, asleep, paused, a weight update under way), or None."""
        if self.closed:
            return SHUT_DOWN
        if self.is_sleeping:
            return "the engine is asleep; call wake_up()"
        if self.paused:
            return "generation is paused; call resume_generation()"
        if self.weight_receiver is not None and self.weight_receiver.active:
            return "a weight update is under way; call finish_weight_update()"
        return None

    @property
    def can_step(self) -> bool:
        return self.hold is None

    def drain(self) -> list[Request]:
        """Read back and process every step in flight; nothing new is launched."""
        updated = []
        while self.in_flight:
            updated += self._process(self.in_flight.popleft())
        return updated

    def _preempt_running(self) -> None:
        """Every running request back to the queue, in order, to recompute its KV, and every
        swapped one before them; what they cached or swapped out is forgotten (no step is in
        flight: see `drain`)."""
        assert not self.in_flight
        for request in reversed(self.scheduler.running):
            self.scheduler.preempt(request, recompute=True)
            self.builder.running_rows.release(request)
        self.scheduler.recompute_swapped()
        self.scheduler.cache.reset()

    def _forget_cached_kv(self) -> None:
        """No KV computed before now is found again: the cache is emptied, and running and
        swapped requests publish no more blocks until they recompute their KV (their later
        blocks attend over stale KV too)."""
        self.scheduler.cache.reset()
        for request in (*self.scheduler.running, *self.scheduler.swapped):
            request.publishes = False

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """vLLM's: `method` (an Engine method's name, or a function taking the engine first) on
        every rank at once, between steps (see rpc.py); each rank's result, rank 0's first. On
        each rank the call sees that rank's engine alone: a method that drives the other ranks
        itself (update_weights, sleep) does not drive them from rank 0 here."""
        check_call(self, method, args, kwargs)
        self._check_open()
        call = (method, tuple(args), kwargs or {})
        workers = self.workers
        if workers is None:  # one rank: the call need not pickle (a lambda will do)
            return [run_call(self, *call)]
        # the others first: a call may join a collective; then ours with the others detached
        workers.start_rpc(self.commands, pickled(*call))
        self.commands = []
        self.workers = None
        try:
            ours = run_call(self, *call)
        except Exception:
            with contextlib.suppress(Exception):  # the others' answers: not left in the pipes
                workers.rpc_results(timeout)
            raise
        finally:
            self.workers = workers
        return [ours, *workers.rpc_results(timeout)]

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list:
        """vLLM's: `func(model)` on every rank's model; each rank's result."""
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}")
        return self.collective_rpc(apply_to_model, args=(func,))

    def _on_other_ranks(self, method: str, *args) -> None:
        """Run `method(*args)` on every other rank's engine now, after the commands queued so far."""
        self.workers.apply([*self.commands, ("call", method, args)])
        self.commands = []

    # ---- the step loop --------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Launch the next step; read back the oldest one in flight when it is due.

        Sync: launch N, read N. Async: launch N+1, then read N, so the device always has
        the next step queued while the CPU processes tokens. Returns the requests that got a
        token or finished.
        """
        if not self.can_step:  # shut down, asleep, paused, ...
            raise RuntimeError(self.hold)
        if self.workers is not None:
            self.workers.step(self.commands)
            self.commands = []
        try:
            launched = self._launch_next()
        except RuntimeError:
            if self.workers is not None:  # a collective failed (gloo): was it a rank dying?
                self.workers.check()
            raise
        due = not self.async_batching or len(self.in_flight) > 1 or not launched
        updated, self.finished_unscheduled = self.finished_unscheduled, []
        if self.in_flight and due:
            try:
                updated += self._process(self.in_flight.popleft())
            except StepFailed as failed:
                failed.updated = updated + failed.updated
                raise
        self._pause_once_drained()
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.stats, time.monotonic())
        return updated

    def _launch_next(self) -> bool:
        step, timeline = self.num_steps, self.timeline
        with timeline.phase("schedule", step):
            plan = self.scheduler.schedule()
            for request in plan.preempted:
                self.builder.running_rows.release(request)
            self.runner.swap(self.scheduler.swap.take_copies(), timeline)
        if not plan.requests:
            return False
        slot = self.runner.slots[step % 2]
        # the slot's last step was read back, so its H2D copy and compute are done
        assert all(b.slot is not slot for b in self.in_flight)
        with timeline.phase("build", step):
            # a prompt's given embeddings enter the forward pass eagerly (prompt_embeds.py)
            embeds = self.config.enable_prompt_embeds and has_embed_rows(
                plan.requests, plan.num_new_tokens
            )
            graph_size = self.runner.padded_size(
                len(plan.requests),
                decode_only=plan.num_tokens == len(plan.requests),
                needs_hidden=has_prompt_logprob_rows(plan.requests, plan.num_new_tokens)
                or has_pooled_rows(plan.requests, plan.num_new_tokens)
                or embeds,
            )
            pieces = graph_size is None and not embeds
            bucket = self.runner.token_bucket(plan.num_tokens) if pieces else None
            batch = self.builder.build(plan, slot, step, graph_size, bucket)
            wanted = self.step_work is not None or timeline.recording
            work = (
                step_work(batch.seq_lens, batch.query_start_loc, batch.shared_kv_tokens)
                if wanted
                else None
            )
            if self.step_work is not None:
                self.step_work.append(work)
        with timeline.phase("launch", step):
            timeline.record_step(step, work)
            # a custom processor's sampling may run in the launch (one that reads no output ids)
            with self._failing_step(batch) if batch.custom_logits else contextlib.nullcontext():
                self.runner.launch(batch, timeline)
        if batch.sampling_waits:  # its masks or processors need the tokens its rows have in flight
            batch.sampling_launched = False
            if not any(batch.requests[row].num_pending_tokens for row in batch.host_rows):
                self._launch_sampling(batch)
        for row, request in enumerate(batch.requests):
            if batch.samples[row]:
                request.num_pending_tokens += 1
                request.pending_row = row
        self.in_flight.append(batch)
        self.num_steps += 1
        return True

    def _process(self, batch: StepBatch) -> list[Request]:
        assert batch.sampling_launched, "a step is read back after its sampling was launched"
        with self.timeline.phase("wait", batch.step):
            out = self.runner.wait(batch, self.check_ranks)
        self.timeline.read_gpu(batch.slot.index, batch.step, batch.sampling_waits)
        with self.timeline.phase("process", batch.step):
            updated = self._append_outputs(batch, out)
        for later in self.in_flight:  # the next step's masks or processors: its rows are current
            if not later.sampling_launched:
                try:
                    self._launch_sampling(later)
                except StepFailed as failed:  # this step's outputs stand: the caller's too
                    failed.updated = updated + failed.updated
                    raise
        return updated

    def _launch_sampling(self, batch: StepBatch) -> None:
        """Launch the sampling of a step that waited for the host: its token masks filled from
        its rows' matchers first, where it has constrained rows. Where that raises (a custom
        processor's error), the step is abandoned and its requests aborted (StepFailed)."""
        with self.timeline.phase("mask", batch.step), self._failing_step(batch):
            if batch.use_mask:
                self.admission.grammars().fill_masks(
                    batch.slot.masks.host, batch.requests, batch.mask_rows, batch.num_seqs_padded
                )
            self.runner.launch_sampling(batch, self.timeline)
        batch.sampling_launched = True

    @contextlib.contextmanager
    def _failing_step(self, batch: StepBatch) -> Iterator[None]:
        """Where the step's sampling raises (a custom processor's error), it is abandoned
        (`Runner.abandon`; never read back, its rows get no token), the steps before it are
        read back (their outputs stand: a request they finish keeps its own), and its
        requests still unfinished are aborted: StepFailed."""
        try:
            yield
        except BaseException as error:
            self.runner.abandon(batch)
            if any(b is batch for b in self.in_flight):  # launched, its sampling not
                self.in_flight = deque(b for b in self.in_flight if b is not batch)
                for row, request in enumerate(batch.requests):
                    request.num_pending_tokens -= batch.samples[row]
            updated = self.drain()
            failed = [request for request in batch.requests if not request.finished]
            for request in failed:
                self.abort(request.request_id)
            if not isinstance(error, Exception):  # Ctrl-C and the like pass as they are
                raise
            step_failed = StepFailed(error, failed)
            step_failed.updated = updated
            raise step_failed from error

    def _append_outputs(self, batch: StepBatch, out: dict[str, np.ndarray]) -> list[Request]:
        num_seqs = len(batch.requests)
        sampled = out["sampled"][:num_seqs].tolist()
        logprobs = None if batch.num_top_logprobs is None else _step_logprobs(out, batch)
        updated = self._append_prompt_logprobs(batch) if batch.prompt_logprobs else []
        if batch.pooling is not None:
            updated += self._append_embeddings(batch)
        for row, request in enumerate(batch.requests):
            if not batch.samples[row]:
                continue
            request.num_pending_tokens -= 1
            if request.finished:
                continue  # stopped or aborted while this step was in flight: discard
            request.output_token_ids.append(sampled[row])
            self.counts.generation_tokens += 1
            if len(request.output_token_ids) == 1:
                self.counts.prompt_tokens += request.num_prompt_tokens
            if logprobs is not None and request.params.logprobs is not None:
                self._append_logprobs(request, batch, logprobs, row)
            updated.append(request)
            gated = request.matcher is not None or request.reasoning_end_id is not None
            ended = accept(request, sampled[row]) if gated else None
            if ended is not None:  # the grammar is complete (its stop token), or broken
                # its stop token's text kept as _check_stop keeps it (include_stop_str_in_output)
                kept = ended == "stop" and request.params.include_stop_str_in_output
                if ended == "stop":
                    request.stop_reason = self._stop_reason(request, sampled[row])
                if kept and request.detokenizer is not None:
                    request.output_text += request.detokenizer.add([sampled[row]])
                self._finish(request, ended, stopped_by_token=not kept)
                continue
            self._check_stop(request)
        return updated

    def _append_embeddings(self, batch: StepBatch) -> list[Request]:
        """Store the step's embeddings; finish their requests (the token they sampled from the
        same row is discarded)."""
        store_embeddings(batch.pooling, batch.slot.pooling, self.model_pooling)
        embedded = []
        for request in batch.pooling.requests:
            if not request.finished:
                self.counts.prompt_tokens += request.num_prompt_tokens
                self._finish(request, "stop")  # as vLLM finishes a pooled request
                embedded.append(request)
        return embedded

    def _append_prompt_logprobs(self, batch: StepBatch) -> list[Request]:
        """Store the step's prompt logprobs; finish the scoring requests (max_tokens=0) that
        have them all."""
        store_prompt_logprobs(batch.prompt_logprobs, batch.slot.prompt_logprobs)
        scored = []
        for segment in batch.prompt_logprobs.segments:
            request = segment.request
            done = request.params.max_tokens == 0 and request.prompt_logprobs_done
            if done and not request.finished:
                self._finish(request, "length")
                scored.append(request)
        return scored

    def _append_logprobs(
        self, request: Request, batch: StepBatch, logprobs: StepLogprobs, row: int
    ) -> None:
        n, named = request.params.logprobs, request.params.logprob_token_ids
        if named is not None:  # the ids it named, in its order
            entry = token_logprob_entry(batch.token_logprobs, batch.slot.token_logprobs, row, named)
        else:
            entry = dict(zip(logprobs.top_ids[row][:n], logprobs.top_values[row][:n], strict=True))
        entry[request.output_token_ids[-1]] = logprobs.sampled[row]
        request.logprobs.append(entry)
        request.sampled_ranks.append(logprobs.ranks[row])

    def _stop_reason(self, request: Request, token: int) -> int | None:
        """vLLM's stop_reason of a stop token: None for the tokenizer's EOS, else the id
        (generation_config's other EOS ids are stop_token_ids there)."""
        primary = not request.params.ignore_eos and token == self.primary_eos_token_id
        return None if primary else token

    def _check_stop(self, request: Request) -> None:
        """As vLLM: EOS and stop_token_ids count from the min_tokens-th output on, stop strings
        only in text after it; a stop token's text is kept with include_stop_str_in_output."""
        params, token = request.params, request.output_token_ids[-1]
        num_out = len(request.output_token_ids)
        stop_token = num_out >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids)
            or token in params.stop_token_ids
        )
        if stop_token:
            request.stop_reason = self._stop_reason(request, token)
            if not params.include_stop_str_in_output:
                return self._finish(request, "stop", stopped_by_token=True)
        if request.detokenizer is not None:
            delta = request.detokenizer.add([token])
            request.output_text += delta
            if (
                not stop_token
                and num_out > params.min_tokens
                and truncate_at_stop(request, len(delta))
            ):
                return self._finish(request, "stop", text_is_final=True)
        num_known = request.num_prompt_tokens + num_out  # not the token still in flight
        if stop_token:
            self._finish(request, "stop")
        elif num_out >= params.max_tokens or num_known >= self.max_model_len:
            self._finish(request, "length")
        elif (
            params.repetition_detection is not None
            and num_out >= params.min_tokens
            and ends_in_repetition(request.output_token_ids, params.repetition_detection)
        ):
            request.stop_reason = "repetition_detected"  # vLLM's
            self._finish(request, "repetition")
        return None

    def _finish(
        self,
        request: Request,
        reason: str,
        text_is_final: bool = False,
        stopped_by_token: bool = False,
    ) -> None:
        if not text_is_final:
            reason = self._final_text(request, reason, stopped_by_token)
        self.scheduler.finish(request, reason)
        if request.lora_request is not None:
            self.adapter_cache.drop(request.lora_request.lora_int_id)
        self.counts.finished[reason] += 1
        self.builder.running_rows.release(request)
        self.requests.pop(request.request_id, None)

    def _final_text(self, request: Request, reason: str, stopped_by_token: bool) -> str:
        """The request's text made whole; returns its finish reason, "stop" where a stop string
        ends in the text the detokenizer held back until now (a character still partial)."""
        if request.detokenizer is not None:
            delta = request.detokenizer.flush()
            request.output_text += delta
            num_out = len(request.output_token_ids)
            ended = (
                reason in ("stop", "length", "repetition") and num_out > request.params.min_tokens
            )
            if ended and truncate_at_stop(request, len(delta)):
                return "stop"
        elif self.tokenizer is not None and request.params.detokenize:
            # as with the detokenizer: a stop token stays in token_ids but not in the text; the
            # text as it reads after the prompt (a lone decode may strip the first space)
            ids = request.output_token_ids[:-1] if stopped_by_token else request.output_token_ids
            request.output_text = self.admission.text_after_prompt(request, ids)
        return reason

    def _use_piecewise(self) -> bool:
        """Steps that no whole graph runs take the pieces (piecewise.py); one device only."""
        pieces = graph_plan(self.config.compilation_config).pieces
        return self._use_cuda_graphs() and self.tp.size == 1 and piecewise.ENABLED and pieces

    def _graph_sizes(self) -> list[int]:
        """The row counts of the decode steps' whole graphs (compilation.py); [] for none."""
        if not self._use_cuda_graphs():
            return []
        rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        plan = graph_plan(self.config.compilation_config)
        return plan.sizes(rows, graph_batch_sizes(rows))

    def _use_cuda_graphs(self) -> bool:
        if self.config.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs device='cuda'")
        eager = self.config.cuda_graphs is False or self.config.enforce_eager
        return self.device.type == "cuda" and not eager


class StepLogprobs(NamedTuple):
    """A step's sample-logprob outputs read back as lists, once for all its rows."""

    sampled: list[float]  # [rows] each sampled token's value
    ranks: list[int]  # [rows]
    top_ids: list[list[int]]  # [rows][the step's widest top-k]
    top_values: list[list[float]]


def _step_logprobs(out: dict[str, np.ndarray], batch: StepBatch) -> StepLogprobs:
    num_seqs = len(batch.requests)
    return StepLogprobs(
        out["sampled_logprob"][:num_seqs].tolist(),
        out["sampled_rank"][:num_seqs].tolist(),
        *batch.slot.top_logprobs.read(num_seqs, batch.num_top_logprobs),
    )


def _eos_token_ids(
    cfg: ModelConfig, folder: Path | None, tokenizer: Tokenizer | None
) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present, else config.json, else the tokenizer;
    a ValueError naming the file if one is not a token id of the model (min_tokens bans them
    by index)."""
    eos, source = generation_config.of_folder(folder).get("eos_token_id"), generation_config.FILE
    if eos is None:
        eos, source = list(cfg.eos_token_ids), "config.json"
    ids = eos if isinstance(eos, list) else [eos]
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < cfg.vocab_size:
            raise ValueError(
                f"{source}'s eos_token_id must be token ids in [0, {cfg.vocab_size}), "
                f"got {eos!r:.80}"
            )
    if ids:
        return tuple(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()


def truncate_at_stop(request: Request, delta_len: int) -> bool:
    """If a stop string ends in the newest `delta_len` characters, cut the output there, note
    it as the stop reason and return True. Each stop string is looked for where it would end in
    the new text, so one that lies wholly in older text (before min_tokens) stops nothing."""
    params, text = request.params, request.output_text
    new = len(text) - delta_len
    hits = [(i, s) for s in params.stop if (i := text.find(s, max(0, new - len(s) + 1))) >= 0]
    if not hits:
        return False
    index, stop = hits[0]  # the first given, wherever the others end, as vLLM's
    request.output_text = (
        text[: index + len(stop)] if params.include_stop_str_in_output else text[:index]
    )
    request.stop_reason = stop
    return True
