"""In-place weight updates: A's engine given B's weights generates what a fresh engine on B does."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.model.tiny import make_tiny_model

ENGINE_ARGS = {"max_model_len": 128, "block_size": 8, "dtype": "float32"}
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 30 + 2 * i, 9, 11, 12, 40, 41, 3]} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def fresh(checkpoints) -> dict[str, list]:
    """Each checkpoint's outputs from an engine started on it."""
    return {path: tokens_and_logprobs(LLM(path, **ENGINE_ARGS)) for path in checkpoints}


def tokens_and_logprobs(llm: LLM) -> list:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_update_weights_then_generate_equals_a_fresh_engine_on_the_new_checkpoint(
    checkpoints, fresh
):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    on_a = tokens_and_logprobs(llm)
    assert [t for t, _ in tokens_and_logprobs(llm)] == [t for t, _ in on_a]  # cache hits now
    cache = llm.engine.scheduler.cache
    hits = cache.num_hit_tokens
    assert hits > 0
    llm.update_weights(load_file(f"{b}/model.safetensors").items())
    on_b = fresh[b]
    assert on_a == fresh[a]
    assert [t for t, _ in on_a] != [t for t, _ in on_b]  # the two checkpoints disagree
    assert tokens_and_logprobs(llm) == on_b
    assert cache.num_hit_tokens == hits  # A's cached KV was forgotten
    llm.update_weights_from_path(a)
    assert [t for t, _ in tokens_and_logprobs(llm)] == [t for t, _ in on_a]


@pytest.mark.parametrize("arch", ["gemma2", "mixtral", "phi3", "qwen3_moe"])
def test_each_architecture_s_checkpoint_names_update_as_they_load(tmp_path, arch):
    """Gemma's norms (stored as 1 + w), Mixtral's expert names, Phi-3's fused matrices and
    transformers 5's fused experts go through the loader's mapping in an update too."""
    a, b = (
        make_tiny_model(tmp_path / name, arch, seed=seed) for name, seed in (("a", 1), ("b", 2))
    )
    if arch == "qwen3_moe":  # b's experts as transformers 5 saves them: one tensor per layer
        fuse_experts(b / "model.safetensors")
    llm = LLM(str(a), **ENGINE_ARGS)
    llm.update_weights_from_path(b)
    assert tokens_and_logprobs(llm) == tokens_and_logprobs(LLM(str(b), **ENGINE_ARGS))


def test_an_expert_past_the_models_is_a_value_error_naming_it(tmp_path):
    folder = make_tiny_model(tmp_path, "mixtral", seed=1)
    state = load_file(folder / "model.safetensors")
    count = len({k for k in state if ".experts." in k and k.endswith("w2.weight")}) // len(
        {k.split(".block_sparse_moe")[0] for k in state if "block_sparse_moe" in k}
    )
    llm = LLM(str(folder), **ENGINE_ARGS)
    before = {k: v.clone() for k, v in llm.engine.model.state_dict().items()}
    name = f"model.layers.0.block_sparse_moe.experts.{count}.w2.weight"
    with pytest.raises(ValueError, match=rf"experts\.{count}\..*no place"):
        llm.update_weights([(name, state["model.layers.0.block_sparse_moe.experts.0.w2.weight"])])
    after = llm.engine.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def fuse_experts(path) -> None:
    """Rewrite per-expert gate/up/down matrices as fused [experts, ...] tensors per layer."""
    state = load_file(path)
    fused: dict[str, torch.Tensor] = {}
    for layer in {k.split(".experts.")[0] for k in state if ".experts." in k}:
        count = len({k for k in state if k.startswith(f"{layer}.experts.") and "down_proj" in k})
        expert = [f"{layer}.experts.{e}" for e in range(count)]
        gate_up = [
            torch.cat([state.pop(f"{x}.gate_proj.weight"), state.pop(f"{x}.up_proj.weight")])
            for x in expert
        ]
        fused[f"{layer}.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{layer}.experts.down_proj"] = torch.stack(
            [state.pop(f"{x}.down_proj.weight") for x in expert]
        )
    save_file({**state, **fused}, path)


def test_a_layer_by_layer_stream_of_tensors_is_applied_like_a_state_dict(checkpoints, fresh):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    state = load_file(f"{b}/model.safetensors")
    llm.update_weights((name, state[name]) for name in sorted(state))  # a generator, one by one
    assert tokens_and_logprobs(llm) == fresh[b]


@pytest.mark.parametrize(
    ("bad_name", "bad_tensor", "error"),
    [
        ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3), "q_proj.weight"),
        ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64), "layers.9"),
        ("model.nonsense", torch.zeros(3), "model.nonsense"),
    ],
)
def test_a_bad_name_or_shape_raises_before_anything_is_copied(
    checkpoints, fresh, bad_name, bad_tensor, error
):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    state = list(load_file(f"{b}/model.safetensors").items())
    with pytest.raises(ValueError, match=error):
        llm.update_weights([*state[:-1], (bad_name, bad_tensor), state[-1]])
    assert tokens_and_logprobs(llm) == fresh[a]  # all of A, none of B


def test_a_non_tensor_is_a_type_error_naming_it(checkpoints):
    llm = LLM(checkpoints[0], **ENGINE_ARGS)
    with pytest.raises(TypeError, match=r"lm_head\.weight"):
        llm.update_weights([("lm_head.weight", [[0.0]])])


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [("", ValueError, "non-empty"), (None, ValueError, "non-empty"),
     ("/no/such/folder", FileNotFoundError, "not a checkpoint folder")],
)  # fmt: skip
def test_a_path_that_names_no_checkpoint_is_refused(checkpoints, fresh, path, error, match):
    llm = LLM(checkpoints[0], **ENGINE_ARGS)
    with pytest.raises(error, match=match):  # "" is no current folder
        llm.update_weights_from_path(path)
    assert tokens_and_logprobs(llm) == fresh[checkpoints[0]]


# 8 blocks of 8 tokens for four 21-token requests: some are swapped out when they pause
SWAPPING = {"num_blocks": 8, "max_model_len": 64, "preemption_mode": "swap"}


@pytest.mark.parametrize("extra", [{}, SWAPPING], ids=["roomy", "swapping"])
def test_an_update_invalidates_the_kv_of_requests_paused_mid_generation(checkpoints, extra):
    """Paused with their KV, updated, resumed with recompute_kv: they finish as on B from the
    tokens they had (each token after the pause greedy under B's weights). Requests swapped
    out to host memory recompute too: their host copy is A's KV."""
    a, b = checkpoints
    llm = LLM(a, **{**ENGINE_ARGS, **extra})
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.enqueue(
            engine.make_request(f"r{i}", GREEDY, prompt_token_ids=prompt["prompt_token_ids"])
        )
    for step in range(40):  # 6 steps, then on until a request is out on the host
        if step >= 6 and (not extra or engine.scheduler.swapped):
            break
        engine.step()
    engine.pause_generation("keep")
    if extra:
        assert engine.scheduler.swapped, "no request was swapped out: the test is void"
    partial = {rid: list(r.output_token_ids) for rid, r in engine.requests.items()}
    assert all(partial.values())
    llm.update_weights_from_path(b)
    engine.resume_generation(recompute_kv=True)
    finished = {r.request_id: r for r in engine.requests.values()}
    while engine.has_unfinished():
        engine.step()
    assert_finished_as_on(b, finished, partial)


def assert_finished_as_on(path: str, finished: dict, partial: dict) -> None:
    """Each request's tokens: those it had (`partial`), then greedy ones of a fresh engine on
    `path` from there."""
    engine = LLM(path, **ENGINE_ARGS)
    for rid, request in finished.items():
        prompt = request.prompt_token_ids + partial[rid]
        rest = engine.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0]
        num_left = GREEDY.max_tokens - len(partial[rid])
        assert request.output_token_ids == partial[rid] + rest.token_ids[:num_left]


def test_two_ranks_take_their_shards_of_an_update(checkpoints, fresh):
    """Tensor parallelism (gloo): each rank copies its slice of the stacked, sharded weights."""
    a, b = checkpoints
    llm = LLM(a, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        llm.update_weights(load_file(f"{b}/model.safetensors").items())
        updated = [t for t, _ in tokens_and_logprobs(llm)]
    finally:
        llm.shutdown()
    assert updated == [t for t, _ in fresh[b]]


class LoadWeights:
    """vLLM's `apply_model(lambda model: model.load_weights(...))`, picklable for other ranks."""

    def __init__(self, path: str):
        self.state = load_file(f"{path}/model.safetensors")

    def __call__(self, model: torch.nn.Module) -> set[str]:
        return model.load_weights(self.state.items())


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_apply_model_load_weights_updates_every_rank_as_update_weights(
    checkpoints, fresh, tensor_parallel_size
):
    """vLLM's RL idiom: the model's own load_weights, called on each rank through apply_model,
    gives what a fresh engine on the new checkpoint gives, and forgets the cached KV."""
    a, b = checkpoints
    llm = LLM(a, tensor_parallel_size=tensor_parallel_size, **ENGINE_ARGS)
    try:
        tokens_and_logprobs(llm)
        tokens_and_logprobs(llm)  # hits: A's KV is cached
        load = LoadWeights(b)
        taken = llm.apply_model(load)
        updated = tokens_and_logprobs(llm)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert taken == [set(load.state)] * tensor_parallel_size
    assert [t for t, _ in updated] == [t for t, _ in fresh[b]]
    if tensor_parallel_size == 1:
        assert updated == fresh[b]
    # each prompt's one full block found in the second round, none in the third
    assert stats.prefix_cache_hits == len(PROMPTS) * ENGINE_ARGS["block_size"]


def load_as_a_worker_extension(engine, path: str) -> tuple[int, int]:
    """A vLLM worker extension's method: `self.model_runner.model.load_weights`, `self.rank`."""
    state = load_file(f"{path}/model.safetensors")
    return engine.rank, len(engine.model_runner.model.load_weights(state.items()))


def test_collective_rpc_reads_vllm_s_worker_attributes_on_every_rank(checkpoints, fresh):
    """RL code written as a vLLM worker extension, run by collective_rpc on each rank."""
    a, b = checkpoints
    llm = LLM(a, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        answers = llm.collective_rpc(load_as_a_worker_extension, args=(b,))
        updated = [t for t, _ in tokens_and_logprobs(llm)]
    finally:
        llm.shutdown()
    count = len(load_file(f"{b}/model.safetensors"))
    assert answers == [(0, count), (1, count)]
    assert updated == [t for t, _ in fresh[b]]


class WeightSync:
    """An RL trainer's vLLM worker extension, written as OpenRLHF and verl write theirs: methods
    that read the worker's rank, device and model, and keep state on the worker."""

    def describe(self) -> tuple[int, str]:
        return self.rank, self.device.type

    def remember(self, path: str) -> None:
        self.checkpoint = path  # this rank's, until a later call reads it

    def load_remembered(self) -> int:
        return self.load_from(self.checkpoint)  # another of the extension's methods

    def load_from(self, path: str) -> int:
        state = load_file(f"{path}/model.safetensors")
        return len(self.model_runner.model.load_weights(weights=state.items()))


class Clashing:
    def sleep(self) -> None:
        """The engine's own name: vLLM refuses such an extension too."""


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_worker_extension_methods_run_by_name_on_every_rank(
    checkpoints, fresh, tensor_parallel_size
):
    """vLLM's worker_extension_cls: collective_rpc names the class's methods, each rank's engine
    their self; what one call sets there, a later call reads."""
    a, b = checkpoints
    tp = tensor_parallel_size
    extension = f"{__name__}.WeightSync"
    llm = LLM(a, tensor_parallel_size=tp, worker_extension_cls=extension, **ENGINE_ARGS)
    try:
        assert llm.collective_rpc("describe") == [(rank, "cpu") for rank in range(tp)]
        assert llm.collective_rpc("remember", args=(b,)) == [None] * tp
        counts = llm.collective_rpc("load_remembered")
        updated = tokens_and_logprobs(llm)
        with pytest.raises(ValueError, match="no public method 'forget'"):
            llm.collective_rpc("forget")
    finally:
        llm.shutdown()
    assert counts == [len(load_file(f"{b}/model.safetensors"))] * tp
    assert [t for t, _ in updated] == [t for t, _ in fresh[b]]


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("nowhere.Extension", "'nowhere.Extension' does not import"),
        ("WeightSync", "qualified name"),
        (f"{__name__}.ENGINE_ARGS", "is no class"),
        (f"{__name__}.Clashing", "defines sleep, which the engine has"),
    ],
)
def test_a_worker_extension_that_cannot_serve_is_a_value_error_saying_why(checkpoints, name, words):
    with pytest.raises(ValueError, match=words):
        LLM(checkpoints[0], worker_extension_cls=name, **ENGINE_ARGS)


def test_a_worker_extension_given_as_a_class_is_a_type_error_asking_for_its_name(checkpoints):
    with pytest.raises(TypeError, match=r"qualified name \(a string\), got type"):
        LLM(checkpoints[0], worker_extension_cls=WeightSync, **ENGINE_ARGS)


def test_collective_rpc_route_runs_worker_extension_methods_in_dev_mode(checkpoints, monkeypatch):
    """vLLM's POST /collective_rpc under VLLM_SERVER_DEV_MODE=1 (and `tandem serve
    --worker-extension-cls`): each rank's result, as JSON has it or as text; then the server
    generates with the weights the extension loaded. Without dev mode there is no such route;
    a method neither the engine nor the extension has is a 400 naming it."""
    from fastapi.testclient import TestClient

    from tandem.async_llm import AsyncLLM
    from tandem.cli import build_parser, server_options
    from tandem.server.app import build_app

    a, b = checkpoints
    args = build_parser().parse_args(
        ["serve", a, "--worker-extension-cls", f"{__name__}.WeightSync"]
    )
    assert not server_options(args, ()).server_dev_mode
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    options = server_options(args, ())
    assert options.server_dev_mode
    llm = AsyncLLM.from_model(a, worker_extension_cls=args.worker_extension_cls, **ENGINE_ARGS)
    prompt = PROMPTS[0]["prompt_token_ids"]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            assert client.post("/collective_rpc", json={"method": "describe"}).status_code == 404
        with TestClient(build_app(llm, "tiny", options=options)) as client:
            rpc = client.post("/collective_rpc", json={"method": "describe"})
            assert rpc.json() == {"results": ["(0, 'cpu')"]}
            rpc = client.post("/collective_rpc", json={"method": "remember", "args": [b]})
            assert rpc.json() == {"results": [None]}
            loaded = client.post("/collective_rpc", json={"method": "load_remembered"}).json()
            answer = client.post("/v1/completions", json={**body, "return_token_ids": True})
            missing = client.post("/collective_rpc", json={"method": "forget"})
    finally:
        llm.shutdown()
    assert loaded == {"results": [str(len(load_file(f"{b}/model.safetensors")))]}
    [want] = LLM(b, **ENGINE_ARGS).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert answer.json()["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "method"


def test_reload_weights_is_vllm_s_worker_method_over_collective_rpc(checkpoints, fresh):
    """`collective_rpc("reload_weights", kwargs=...)`: a weights_path, the pairs given, or
    with neither the model's own checkpoint again."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    assert llm.collective_rpc("reload_weights", kwargs={"weights_path": b}) == [None]
    assert tokens_and_logprobs(llm) == fresh[b]
    llm.collective_rpc("reload_weights")
    assert tokens_and_logprobs(llm) == fresh[a]
    pairs = list(load_file(f"{b}/model.safetensors").items())
    llm.collective_rpc("reload_weights", args=(pairs,))
    assert tokens_and_logprobs(llm) == fresh[b]
    with pytest.raises(ValueError, match="is_checkpoint_format must be True"):
        llm.collective_rpc("reload_weights", kwargs={"is_checkpoint_format": False})
    small = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
             "eos_token_id": 2, "bos_token_id": 1}  # fmt: skip
    preset = LLM("qwen2.5-0.5b", load_format="dummy", hf_overrides=small, max_model_len=32)
    with pytest.raises(ValueError, match="a preset with no checkpoint folder"):
        preset.collective_rpc("reload_weights")


def test_one_rank_s_update_copies_no_tensor_to_host_memory(checkpoints, fresh, monkeypatch):
    """On one rank nothing goes through pipes: a trainer's device tensors are copied in place,
    not to the host first (16 GB of an 8B model's would be)."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    state = load_file(f"{b}/model.safetensors")

    def no_host_copy(tensor, *args, **kwargs):
        raise AssertionError("a weight was copied to host memory")

    monkeypatch.setattr(torch.Tensor, "cpu", no_host_copy)
    assert llm.engine.update_weights(state.items()) == set(state)
    monkeypatch.undo()
    assert tokens_and_logprobs(llm) == fresh[b]


def test_load_weights_on_a_model_no_engine_serves_is_a_runtime_error(checkpoints):
    llm = LLM(checkpoints[0], **ENGINE_ARGS)
    model = llm.engine.model
    llm.shutdown()
    del llm
    gc.collect()
    with pytest.raises(RuntimeError, match="the engine that serves this model, and none does"):
        model.load_weights([])


def test_two_ranks_take_stacked_names_and_name_a_wrong_shape(checkpoints, fresh):
    """An engine's own stacked names (qkv_proj, gate_up_proj: its named_parameters) are sliced
    part by part on each rank, as one rank takes them; a wrong shape is a ValueError naming
    the tensor (it was a RuntimeError from a slice), and nothing is copied."""
    a, b = checkpoints
    state = load_file(f"{b}/model.safetensors")
    stacked = dict(state)
    for layer in {k.split(".self_attn.")[0] for k in state if ".self_attn." in k}:
        for fused, parts, where in (
            ("qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn"),
            ("gate_up_proj", ("gate_proj", "up_proj"), "mlp"),
        ):
            names = [f"{layer}.{where}.{part}.weight" for part in parts]
            stacked[f"{layer}.{where}.{fused}.weight"] = torch.cat([stacked.pop(n) for n in names])
    llm = LLM(a, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        for name, bad in (
            ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3)),
            ("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 3)),
        ):
            with pytest.raises(ValueError, match=re.escape(repr(name))):
                llm.update_weights([(name, bad)])
        intact = [t for t, _ in tokens_and_logprobs(llm)]
        llm.update_weights(stacked.items())
        updated = [t for t, _ in tokens_and_logprobs(llm)]
    finally:
        llm.shutdown()
    assert intact == [t for t, _ in fresh[a]]
    assert updated == [t for t, _ in fresh[b]]


def test_requests_running_through_an_update_publish_no_stale_blocks(checkpoints):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.enqueue(
            engine.make_request(f"r{i}", GREEDY, prompt_token_ids=prompt["prompt_token_ids"])
        )
    for _ in range(3):
        engine.step()
    assert engine.scheduler.cache.num_cached_blocks > 0  # their prompts' first blocks
    llm.update_weights_from_path(b)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.cache.num_cached_blocks == 0  # they kept A's KV: none of it cached


def enqueue_prompts(engine) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.enqueue(
            engine.make_request(f"r{i}", GREEDY, prompt_token_ids=prompt["prompt_token_ids"])
        )


@pytest.mark.parametrize("swapped_at_update", [True, False])
def test_requests_swapped_out_through_an_update_publish_no_stale_blocks(
    checkpoints, swapped_at_update
):
    """Their host copy holds A's KV: swapped back in, its blocks stay unpublished, whether the
    request was out at the update or went out after it."""
    a, b = checkpoints
    llm = LLM(a, **{**ENGINE_ARGS, **SWAPPING})
    engine = llm.engine
    enqueue_prompts(engine)
    for _ in range(60):
        engine.step()
        if bool(engine.scheduler.swapped) == swapped_at_update and engine.requests:
            break
    assert bool(engine.scheduler.swapped) == swapped_at_update, "the test is void"
    llm.update_weights_from_path(b)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.cache.num_cached_blocks == 0  # none of A's KV is found again


def test_resume_with_recompute_kv_reads_back_the_steps_in_flight(checkpoints):
    """From another thread, between two steps of an async engine, without a pause: the step in
    flight is read back first, then every request recomputes its KV under B's weights."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS, async_batching=True)
    engine = llm.engine
    enqueue_prompts(engine)
    for _ in range(4):
        engine.step()
    assert engine.in_flight, "no step in flight: the test is void"
    llm.update_weights_from_path(b)
    updated = engine.resume_generation(recompute_kv=True)
    assert updated and not engine.in_flight
    partial = {rid: list(r.output_token_ids) for rid, r in engine.requests.items()}
    finished = dict(engine.requests)
    while engine.has_unfinished():
        engine.step()
    assert_finished_as_on(b, finished, partial)
