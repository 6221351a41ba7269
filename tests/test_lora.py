"""LoRA adapters (lora.py, model/lora.py): a request under an adapter gives the tokens of the
base weights with the adapter merged in (W + alpha / r * B @ A, written out and run by
transformers); adapters and the base model mix in one step, slots are reused, the prefix cache
keeps each adapter's KV apart; bad input."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from tandem import LLM, BeamSearchParams, LoRARequest, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser, lora_modules, server_options
from tandem.engine import Engine
from tandem.lora.adapters import check_adapter_config
from tandem.model import fused, splitk
from tandem.model.decoder import to_residual
from tandem.model.lora import LoRALayers, LoRAProjection
from tandem.model.tiny import LORA_TARGETS, make_tiny_lora
from tandem.parallel import TensorParallel
from tandem.prefix_cache import first_extra_key
from tandem.request import Request
from tandem.runner import Runner
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.tokenizer import Tokenizer
from test_bad_input import transformers_greedy as greedy_of
from test_hub import cache_repo
from test_server import running

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROMPTS = ["Hello there", "The quick brown fox jumps over", "café au lait " * 4, "Paged KV"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
JSON = {"content-type": "application/json"}
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3's checkpoint matrices


def merged_folder(base: Path, adapter: Path, out: Path) -> Path:
    """The base checkpoint with the adapter merged into its weights: W + alpha / r * B @ A."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    weights = load_file(base / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    for name in weights:
        module = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{module}.lora_A.weight" in lora:
            delta = lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
            weights[name] = weights[name] + scale * delta
    shutil.copytree(base, out)
    save_file(weights, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.fixture(scope="module")
def lora_models(make_tiny, tmp_path_factory):
    """arch -> (base folder, {adapter id: (adapter folder, merged folder)})."""
    made = {}

    def make(arch: str):
        if arch not in made:
            base = make_tiny(arch)
            # GLM-4's gate and up are one checkpoint matrix, as Phi-3's q/k/v and gate/up are
            targets = FUSED if arch.startswith("phi") else (*LORA_TARGETS, "gate_up_proj")
            adapters = {}
            for lora_id, rank in ((1, 8), (2, 4)):
                root = tmp_path_factory.mktemp(f"lora-{arch}-{lora_id}")
                adapter = make_tiny_lora(root / "adapter", base, rank, lora_id, targets)
                adapters[lora_id] = (adapter, merged_folder(base, adapter, root / "merged"))
            made[arch] = (base, adapters)
        return made[arch]

    return make


def request_of(adapters, lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, str(adapters[lora_id][0]))


def transformers_greedy(folder: str | Path, prompt: str) -> list[int]:
    """transformers' greedy tokens of the checkpoint `folder` for `prompt`."""
    ids = Tokenizer.from_dir(Path(folder)).encode(prompt)
    return greedy_of(Path(folder), tuple(ids), GREEDY.max_tokens)


def alone(folder: str | Path, method: str, *args, **kwargs):
    """`method`'s answer from an engine of `folder` alone (adapters off), collected before it
    returns: on a GPU the next engine sizes its KV cache by the free memory."""
    llm = LLM(str(folder), max_model_len=64)
    answer = getattr(llm, method)(*args, **kwargs)
    llm.engine.shutdown()
    del llm
    gc.collect()
    return answer


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


LORA_ARCHS = [
    "llama", "qwen3", "gemma2", "phi3", "phi4_mini", "qwen3_moe", "olmo3", "granite", "glm4",
    "ernie4_5",
]  # fmt: skip


@pytest.mark.parametrize("arch", LORA_ARCHS)
def test_adapter_tokens_equal_transformers_with_the_adapter_merged(lora_models, arch):
    base, adapters = lora_models(arch)
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2)
    for lora_id in (1, 2):
        got = tokens(llm.generate(PROMPTS, GREEDY, False, request_of(adapters, lora_id)))
        merged = str(adapters[lora_id][1])
        assert got == [transformers_greedy(merged, p) for p in PROMPTS]
    plain = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert plain == [transformers_greedy(str(base), p) for p in PROMPTS]
    assert plain != got  # the adapters change the tokens


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"async_batching": False}, {"max_num_batched_tokens": 7}, {"pieces": True}],
    ids=["async", "sync", "chunked", "pieces"],
)
def test_adapters_and_the_base_model_mix_in_one_step(lora_models, monkeypatch, engine_args):
    base, adapters = lora_models("llama")
    if engine_args.pop("pieces", False):  # steps cut at their attentions (piecewise.py)
        monkeypatch.setattr(Engine, "_use_piecewise", lambda self: True)
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2, **engine_args)
    loras = [request_of(adapters, 1), None, request_of(adapters, 2), request_of(adapters, 1)]
    outputs = llm.generate(PROMPTS, GREEDY, False, loras)
    assert [o.lora_request for o in outputs] == loras
    assert [o.outputs[0].lora_request for o in outputs] == loras  # vLLM's CompletionOutput's too
    got = tokens(outputs)
    folders = [adapters[1][1], base, adapters[2][1], adapters[1][1]]
    assert got == [transformers_greedy(str(f), p) for f, p in zip(folders, PROMPTS, strict=True)]


def test_steps_whose_rows_name_no_adapter_leave_the_products_out(lora_models, monkeypatch):
    """An adapter engine's steps of base-model rows alone run no LoRA product, eagerly or in a
    decode graph (captured both ways on CUDA); a step with an adapter row runs them, its base
    rows included, and every row's tokens are its own model's."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True)
    runner = llm.engine.runner
    steps = []  # per step: (uses_lora, the eager products' `active`, the graph keys replayed)
    add, forward_step = LoRAProjection.add, Runner._forward_step
    graph_keys = {id(graph): key for key, graph in runner.graphs.items()}

    def counted_add(self, x, y):
        steps[-1][1].append(self.layers.active)
        return add(self, x, y)

    def recorded_step(self, batch):
        steps.append((batch.uses_lora, [], []))
        return forward_step(self, batch)

    monkeypatch.setattr(LoRAProjection, "add", counted_add)
    monkeypatch.setattr(Runner, "_forward_step", recorded_step)
    if runner.graphs:
        replay = torch.cuda.CUDAGraph.replay

        def recorded_replay(graph):
            if steps and id(graph) in graph_keys:
                steps[-1][2].append(graph_keys[id(graph)])
            return replay(graph)

        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", recorded_replay)

    plain = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert steps and not any(uses for uses, _, _ in steps)
    assert not any(active for _, eager, _ in steps for active in eager)
    forward_keys = [key for _, _, keys in steps for key in keys if key[0] == "forward"]
    assert all(key[-1] is False for key in forward_keys)
    assert forward_keys or any(eager for _, eager, _ in steps)  # some step ran, eager or graphed
    steps.clear()
    loras = [None, request_of(adapters, 1), None, None]
    mixed = tokens(llm.generate(PROMPTS, GREEDY, False, loras))
    assert all(uses for uses, _, _ in steps)  # request 1 runs to the end with the others
    assert all(active for _, eager, _ in steps for active in eager)
    assert all(key[-1] is True for _, _, keys in steps for key in keys if key[0] == "forward")
    assert mixed[0] == plain[0] and mixed[2:] == plain[2:] and mixed[1] != plain[1]


def test_one_slot_serves_two_adapters_in_turn(lora_models):
    """max_loras=1: an adapter's requests wait while the other's run (base requests do not),
    then take the slot over; every output is its own adapter's."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=1)
    loads = []
    load = llm.engine.model.lora.load
    llm.engine.model.lora.load = lambda slot, adapter: (loads.append(adapter), load(slot, adapter))
    prompts = PROMPTS * 2
    loras = [request_of(adapters, 1 + i % 2) if i % 4 != 1 else None for i in range(8)]
    got = tokens(llm.generate(prompts, GREEDY, False, loras))
    folders = [base if lora is None else adapters[lora.lora_int_id][1] for lora in loras]
    assert got == [transformers_greedy(str(f), p) for f, p in zip(folders, prompts, strict=True)]
    assert len(loads) >= 2 and {a.request.lora_int_id for a in loads} == {1, 2}
    assert llm.engine.scheduler.adapters.holders == [0]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_preempted_requests_give_their_slot_back_and_resume_under_their_adapter(
    lora_models, preemption_mode, async_batching
):
    """Too few KV blocks for every request at once: running requests are preempted (by
    recompute or swap) while others hold or wait for the one adapter slot; every output is
    still its adapter's, and every slot and block comes back."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=1, block_size=4,
              num_blocks=16, max_num_batched_tokens=16, preemption_mode=preemption_mode,
              async_batching=async_batching)  # fmt: skip
    prompts = (PROMPTS * 2)[:6]
    loras = [request_of(adapters, 1 + i % 2) if i != 3 else None for i in range(6)]
    got = tokens(llm.generate(prompts, GREEDY, False, loras))
    assert llm.engine.scheduler.num_preemptions > 0
    folders = [base if lora is None else adapters[lora.lora_int_id][1] for lora in loras]
    assert got == [transformers_greedy(f, p) for f, p in zip(folders, prompts, strict=True)]
    assert llm.engine.scheduler.adapters.holders == [0]
    assert llm.engine.allocator.num_free == llm.engine.num_blocks


def test_priorities_order_requests_of_several_adapters(lora_models):
    """scheduling_policy="priority" with one slot for two adapters: every output its adapter's."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=1, max_num_seqs=2,
              scheduling_policy="priority")  # fmt: skip
    loras = [request_of(adapters, 1 + i % 2) if i != 2 else None for i in range(6)]
    prompts = (PROMPTS * 2)[:6]
    outputs = llm.generate(prompts, GREEDY, False, loras, priority=[3, 0, 2, -1, 1, 0])
    folders = [base if lora is None else adapters[lora.lora_int_id][1] for lora in loras]
    want = [transformers_greedy(f, p) for f, p in zip(folders, prompts, strict=True)]
    assert tokens(outputs) == want


def test_the_prefix_cache_keeps_each_adapter_s_kv_apart(lora_models):
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=96, enable_lora=True, max_loras=2, block_size=4)
    prompt = "a shared prompt of some length, " * 2
    first = llm.generate(prompt, GREEDY, False, request_of(adapters, 1))[0]
    again = llm.generate(prompt, GREEDY, False, request_of(adapters, 1))[0]
    other = llm.generate(prompt, GREEDY, False, request_of(adapters, 2))[0]
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert other.outputs[0].token_ids == transformers_greedy(str(adapters[2][1]), prompt)
    assert plain.outputs[0].token_ids == transformers_greedy(str(base), prompt)


def test_an_id_given_to_another_adapter_after_eviction_meets_none_of_its_kv(lora_models):
    """One adapter held on the host (max_cpu_loras=1): once adapter 1 has left it, its id may
    name adapter 2's folder, as in vLLM; that request's tokens are adapter 2's, not computed
    over KV that the prefix cache keeps from adapter 1."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=96, enable_lora=True, max_loras=1, max_cpu_loras=1,
              block_size=4)  # fmt: skip
    prompt = "a shared prompt of some length, " * 2
    llm.generate(prompt, GREEDY, False, request_of(adapters, 1))
    llm.generate(prompt, GREEDY, False, request_of(adapters, 2))  # adapter 1 leaves the cache
    rebound = LoRARequest("adapter-2-again", 1, str(adapters[2][0]))
    got = llm.generate(prompt, GREEDY, False, rebound)[0]
    assert got.num_cached_tokens == 0
    assert got.outputs[0].token_ids == transformers_greedy(str(adapters[2][1]), prompt)


def test_an_id_given_to_another_adapter_never_runs_the_first_ones_slot(lora_models):
    """Two slots: adapter 1 keeps its slot after it left the host cache (a refused request
    read another); its id then naming adapter 2's folder runs adapter 2, not the slot's old
    weights."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2, max_cpu_loras=2)
    llm.generate(PROMPTS[0], GREEDY, False, request_of(adapters, 1))
    llm.generate(PROMPTS[0], GREEDY, False, request_of(adapters, 2))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("word " * 200, GREEDY, False, LoRARequest("three", 3, str(adapters[1][0])))
    assert 1 not in llm.engine.adapter_cache.adapters  # left the host cache, not its slot
    rebound = LoRARequest("adapter-2-again", 1, str(adapters[2][0]))
    got = tokens(llm.generate(PROMPTS[1], GREEDY, False, rebound))
    assert got == [transformers_greedy(str(adapters[2][1]), PROMPTS[1])]


def test_one_id_for_two_adapters_in_one_call_is_refused_before_anything_runs(lora_models):
    """The host cache holds one adapter: the call's first adapter has left it before its last
    prompt gives that id to another. Refused whole, as a clash between calls is; the engine
    serves on, and a call of more adapters than the cache holds reads each before it runs."""
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=1, max_cpu_loras=1)
    one, two = adapters[1][0], adapters[2][0]
    loras = [LoRARequest("a", 1, str(one)), LoRARequest("b", 2, str(two)),
             LoRARequest("c", 3, str(one)), LoRARequest("x", 1, str(two))]  # fmt: skip
    with pytest.raises(ValueError, match="lora_int_id 1 names adapter 'a'"):
        llm.generate(PROMPTS, GREEDY, False, loras)
    with pytest.raises(ValueError, match="lora_int_id 1 names adapter 'a'"):
        llm.embed(PROMPTS, use_tqdm=False, lora_request=loras)
    assert not llm.engine.has_unfinished() and llm.engine.adapter_cache.users == {}
    # an adapter that cannot be read again as the call's third request is queued: the two
    # queued before it leave too, their adapters no longer held
    read, calls = llm.engine.adapter_cache.read, []

    def fail_third(lora):
        calls.append(lora)
        if lora.lora_name == "c" and len(calls) > 3:
            raise OSError("the folder is gone")
        return read(lora)

    llm.engine.adapter_cache.read = fail_third
    with pytest.raises(ValueError, match="the folder is gone"):
        llm.generate(PROMPTS[:3], GREEDY, False, loras[:3])
    assert not llm.engine.has_unfinished() and llm.engine.adapter_cache.users == {}
    llm.engine.adapter_cache.read = read
    loras[3] = LoRARequest("a", 1, str(one))
    read = llm.engine.adapter_cache.read
    reads_while_stepping = []
    step = llm.engine.step
    llm.engine.step = lambda: (reads_while_stepping.append(len(calls)), step())[1]
    calls = []
    llm.engine.adapter_cache.read = lambda lora: (calls.append(lora.lora_name), read(lora))[1]
    got = tokens(llm.generate(PROMPTS, GREEDY, False, loras))
    folders = [adapters[1][1], adapters[2][1], adapters[1][1], adapters[1][1]]
    assert got == [transformers_greedy(str(f), p) for f, p in zip(folders, PROMPTS, strict=True)]
    assert len(set(reads_while_stepping)) == 1  # no step read an adapter from disk
    assert not llm.engine.has_unfinished() and llm.engine.adapter_cache.users == {}


def test_an_adapter_named_by_a_hub_repository_id(lora_models, tmp_path):
    """lora_path may be a Hub repository id, read from the Hub's cache (offline in the tests)."""
    base, adapters = lora_models("llama")
    cache_repo(tmp_path, "org/adapter", {"c" * 40: ("main", adapters[2][0])})
    llm = LLM(str(base), max_model_len=64, enable_lora=True, download_dir=str(tmp_path))
    got = tokens(llm.generate(PROMPTS[:1], GREEDY, False, LoRARequest("hub", 9, "org/adapter")))
    assert got == [transformers_greedy(adapters[2][1], PROMPTS[0])]
    with pytest.raises(ValueError, match="org/missing"):
        llm.generate("x", GREEDY, False, LoRARequest("gone", 10, "org/missing"))


def test_first_block_keys_differ_by_adapter_and_never_meet_a_salt():
    def key(lora_id=None, salt=None):
        lora = LoRARequest("x", lora_id, "/adapter") if lora_id else None
        return first_extra_key(Request("r", [1], GREEDY, 0, cache_salt=salt, lora_request=lora))

    keys = [key(), key(1), key(2), key(1, "s"), key(salt="s"), key(12)]
    assert len(set(keys)) == len(keys)
    request = Request("r", [1], GREEDY, 0, lora_request=LoRARequest("y", 1, "/adapter"))
    assert first_extra_key(request) != key(1)  # one id, another adapter: its own KV
    request = Request("r", [1], GREEDY, 0, lora_request=LoRARequest("x", 1, "/elsewhere"))
    assert first_extra_key(request) != key(1)
    assert key(salt="\udcfflora:1") != key(1)  # no salt's UTF-8 starts with the adapter's 0xff


class Stub(torch.nn.Module):
    """One attention layer's projections (no MLP): hidden size `hidden`, q and kv sizes."""

    def __init__(self, hidden: int = 6, q: int = 6, kv: int = 2, o_bias: bool = True):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(4, hidden)
        attn = torch.nn.Module()
        attn.qkv_proj = torch.nn.Linear(hidden, q + 2 * kv)
        attn.o_proj = torch.nn.Linear(q, hidden, bias=o_bias)
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = attn, torch.nn.Module()
        self.layers = torch.nn.ModuleList([layer])  # moved by .to(device), as the decoder's
        self.cfg = type("Cfg", (), {"q_size": q, "kv_size": kv, "intermediate_size": 0})


def test_the_delta_of_each_token_is_its_own_slot_s_adapter():
    """model/lora.py's two masked products against the direct formula, token by token."""
    torch.manual_seed(0)
    model = Stub()
    lora = LoRALayers(model, slots=3, rank=2, max_tokens=8)
    a = {s: torch.randn(3, 2, 6) for s in range(3)}  # [lanes, rank, in]
    b = {s: torch.randn(10, 3, 2) for s in range(3)}  # [out, lanes, rank]
    for slot in range(3):  # lane i's B is non-zero in its own rows only (q 0-5, k 6-7, v 8-9)
        for lane, rows in enumerate((range(0, 6), range(6, 8), range(8, 10))):
            keep = torch.zeros(10, dtype=torch.bool)
            keep[list(rows)] = True
            b[slot][~keep, lane] = 0
        lora.projections[(0, "qkv_proj")].load(slot, a[slot], b[slot])
    token_slots = torch.tensor([2, -1, 0, 1, 2], dtype=torch.int32)
    lora.select(token_slots)
    x, y = torch.randn(5, 6), torch.randn(5, 10)
    got = lora.projections[(0, "qkv_proj")].add(x, y)
    for t, slot in enumerate(token_slots.tolist()):
        want = y[t].clone()
        if slot >= 0:
            for lane in range(3):
                want += b[slot][:, lane] @ (a[slot][lane] @ x[t])
        torch.testing.assert_close(got[t], want)


def test_the_o_projection_takes_split_k_in_a_step_without_adapter_rows(monkeypatch):
    """to_residual: with adapter rows, the plain product plus the delta; without (`active`
    False), split-K's partial sums, whose sum is the plain product."""
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)  # interpreted on CPU
    monkeypatch.setattr(splitk, "ENABLED", True)
    monkeypatch.setattr(splitk, "num_sms", lambda device: 8)
    torch.manual_seed(0)
    model = Stub(hidden=64, q=256, kv=16, o_bias=False).to(DEVICE)
    lora = LoRALayers(model, slots=2, rank=2, max_tokens=8)
    o_proj = model.layers[0].self_attn.o_proj
    a, b = torch.randn(1, 2, 256, device=DEVICE), torch.randn(64, 1, 2, device=DEVICE)
    lora.projections[(0, "o_proj")].load(1, a, b)
    lora.select(torch.tensor([1, -1, 1], dtype=torch.int32, device=DEVICE))
    x = torch.randn(3, 256, device=DEVICE)
    plain = x @ o_proj.weight.T
    got = to_residual(o_proj, x, TensorParallel())
    delta = torch.stack([b[:, 0] @ (a[0] @ row) for row in x])
    delta[1] = 0
    torch.testing.assert_close(got, plain + delta, atol=1e-4, rtol=1e-4)
    lora.active = False
    partials = to_residual(o_proj, x, TensorParallel())
    assert partials.dim() == 3 and partials.shape[0] > 1  # [splits, rows, out]
    torch.testing.assert_close(partials.sum(0), plain, atol=1e-4, rtol=1e-4)


def test_an_embedding_under_an_adapter_is_the_merged_model_s(lora_models):
    base, adapters = lora_models("llama")
    theirs = alone(adapters[1][1], "embed", PROMPTS[:2], use_tqdm=False)
    llm = LLM(str(base), max_model_len=64, enable_lora=True)
    ours = llm.embed(PROMPTS[:2], use_tqdm=False, lora_request=request_of(adapters, 1))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding)
        )


def test_async_llm_streams_under_an_adapter(lora_models):
    base, adapters = lora_models("llama")

    async def main():
        llm = AsyncLLM.from_model(str(base), max_model_len=64, enable_lora=True)
        try:
            final = None
            stream = llm.generate(PROMPTS[1], GREEDY, "r1", lora_request=request_of(adapters, 2))
            async for output in stream:
                final = output
            assert final.lora_request == request_of(adapters, 2)
            return final.outputs[0].token_ids
        finally:
            llm.shutdown()

    assert asyncio.run(main()) == transformers_greedy(str(adapters[2][1]), PROMPTS[1])


def test_async_llm_adds_lists_pins_and_removes_adapters_as_vllms(lora_models):
    """vLLM's add_lora / list_loras / pin_lora / remove_lora: an added adapter is held before
    any request names it, a pinned one outlives max_cpu_loras, a removed one is read again by
    the next request that names it (the merged model's tokens either way)."""
    base, adapters = lora_models("llama")
    first, second = request_of(adapters, 1), request_of(adapters, 2)

    async def main():
        llm = AsyncLLM.from_model(
            str(base), max_model_len=64, enable_lora=True, max_loras=1, max_cpu_loras=1
        )
        try:
            assert await llm.list_loras() == set()
            assert await llm.add_lora(first) is True
            assert await llm.list_loras() == {1}
            assert await llm.pin_lora(1) is True and await llm.pin_lora(7) is False
            await llm.add_lora(second)  # one CPU slot: 1 stays pinned beside it
            assert await llm.list_loras() == {1, 2}
            assert await llm.remove_lora(1) is True and await llm.remove_lora(1) is False
            final = [o async for o in llm.generate(PROMPTS[1], GREEDY, "r", lora_request=first)]
            return final[-1].outputs[0].token_ids
        finally:
            llm.shutdown()

    assert asyncio.run(main()) == transformers_greedy(str(adapters[1][1]), PROMPTS[1])
    plain = AsyncLLM.from_model(str(base), max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            asyncio.run(plain.add_lora(first))
    finally:
        plain.shutdown()


@pytest.mark.skipif(
    torch.cuda.device_count() == 1, reason="two ranks on CUDA need two GPUs (CPU: two processes)"
)
@pytest.mark.parametrize("arch", ["qwen3", "phi4_mini"])
def test_two_ranks_give_one_rank_s_tokens_under_adapters(lora_models, arch):
    base, adapters = lora_models(arch)
    loras = [request_of(adapters, 1), None, request_of(adapters, 2), request_of(adapters, 1)]
    results = []
    for size in (1, 2):
        llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2,
                  tensor_parallel_size=size)  # fmt: skip
        try:
            results.append(tokens(llm.generate(PROMPTS, GREEDY, False, loras)))
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]


def test_bad_adapters_are_refused_and_harm_no_other_request(lora_models, tmp_path):
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_lora_rank=8)
    queued = llm.enqueue(PROMPTS[:2], GREEDY, lora_request=request_of(adapters, 1))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        llm.generate("x", GREEDY, False, LoRARequest("missing", 3, str(tmp_path / "none")))
    high = make_tiny_lora(tmp_path / "high", base, rank=16)
    with pytest.raises(ValueError, match="over max_lora_rank=8"):
        llm.generate("x", GREEDY, False, LoRARequest("high", 4, str(high)))
    with pytest.raises(ValueError, match="needs an id of its own"):
        llm.generate("x", GREEDY, False, LoRARequest("other", 1, str(adapters[2][0])))
    head = make_tiny_lora(tmp_path / "head", base, rank=4)
    tensors = load_file(head / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, head / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="lm_head"):
        llm.generate("x", GREEDY, False, LoRARequest("head", 5, str(head)))
    dora = make_tiny_lora(tmp_path / "dora", base, rank=4)
    config = json.loads((dora / "adapter_config.json").read_text())
    # PEFT's fields that change what the adapter computes, which tandem does not run
    for field, value, what in [
        ("use_dora", True, "DoRA"),
        ("alora_invocation_tokens", [5, 6], "activated LoRA"),
        ("layer_replication", [[0, 1], [0, 1]], "layer_replication"),
        ("lora_bias", True, "LoRA biases"),
    ]:
        (dora / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=what):
            llm.generate("x", GREEDY, False, LoRARequest(field, 6, str(dora)))
    cut = make_tiny_lora(tmp_path / "cut", base, rank=4)  # an interrupted download
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is not a readable"):
        llm.generate("x", GREEDY, False, LoRARequest("cut", 8, str(cut)))
    (cut / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"adapter_config\.json is not a readable JSON file"):
        llm.generate("x", GREEDY, False, LoRARequest("cut", 8, str(cut)))
    foreign = lora_models("qwen3")[1][1][0]  # another model's adapter
    with pytest.raises(ValueError, match="another model"):
        llm.generate("x", GREEDY, False, LoRARequest("foreign", 7, str(foreign)))
    with pytest.raises(TypeError, match="LoRARequest"):
        llm.generate("x", GREEDY, False, {"lora_name": "a"})
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate(["x"], GREEDY, False, [None, None])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, str(adapters[1][0]))
    # vLLM's other fields: at their defaults the same adapter, else a ValueError saying why
    assert LoRARequest("a", 1, "/p", None, None, False, False) == LoRARequest("a", 1, "/p")
    with pytest.raises(ValueError, match="give the new weights a new lora_int_id"):
        LoRARequest("a", 1, "/p", load_inplace=True)
    with pytest.raises(ValueError, match="PEFT folder"):
        LoRARequest("a", 1, "/p", is_3d_lora_weight=True)
    outputs = llm.wait_for_completion(use_tqdm=False)  # the queued requests are whole
    assert [o.request_id for o in outputs] == queued
    assert tokens(outputs) == [transformers_greedy(str(adapters[1][1]), p) for p in PROMPTS[:2]]
    assert not llm.engine.has_unfinished() and llm.engine.adapter_cache.users == {}


def test_a_config_without_lora_alpha_scales_by_pefts_default_alpha_of_8():
    """PEFT's LoraConfig defaults lora_alpha to 8 and runs such a config with 8 / r."""
    lora = LoRARequest("a", 1, "/adapter")
    assert check_adapter_config(lora, {"r": 4}, 8) == (4, 2.0)
    assert check_adapter_config(lora, {"r": 4, "use_rslora": True}, 8) == (4, 4.0)


def test_adapters_need_enable_lora_and_unquantized_weights(lora_models):
    base, adapters = lora_models("llama")
    llm = LLM(str(base), max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("x", GREEDY, False, request_of(adapters, 1))
    with pytest.raises(ValueError, match="drop quantization"):
        LLM(str(base), enable_lora=True, quantization="fp8")
    with pytest.raises(ValueError, match="max_loras"):
        LLM(str(base), enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_the_server_serves_lora_modules_as_models(lora_models):
    """--lora-modules NAME=PATH: the adapter is a model of /v1/models whose requests run under
    it and whose answers carry its name; the base model and an unknown name as before."""
    base, adapters = lora_models("llama")
    args = build_parser().parse_args(
        ["serve", str(base), "--enable-lora", "--lora-modules", f"one={adapters[1][0]}",
         f'{{"name": "two", "path": "{adapters[2][0]}"}}']
    )  # fmt: skip
    modules = lora_modules(args.lora_modules, args.enable_lora)
    assert [(m.lora_name, m.lora_int_id) for m in modules] == [("one", 1), ("two", 2)]
    # the merged model's beams, from an engine that is gone before the server's starts (on a GPU
    # each engine sizes its KV cache by the free memory)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    [want] = alone(adapters[2][1], "beam_search", PROMPTS[1:2], params)
    llm = AsyncLLM.from_model(str(base), max_model_len=64, enable_lora=True, max_loras=2)
    try:
        with running(build_app(llm, "base", options=ServerOptions(lora_modules=modules))) as url:
            cards = httpx.get(f"{url}/v1/models").json()["data"]
            assert [(c["id"], c["parent"]) for c in cards] == [
                ("base", None), ("one", "base"), ("two", "base"),
            ]  # fmt: skip
            for model, folder in (("two", adapters[2][1]), ("base", base)):
                body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
                body |= {"ignore_eos": True, "return_token_ids": True}
                answer = httpx.post(f"{url}/v1/completions", json=body)
                assert answer.status_code == 200 and answer.json()["model"] == model
                got = answer.json()["choices"][0]["token_ids"]
                assert got == transformers_greedy(str(folder), PROMPTS[1])
            body = {"model": "three", "prompt": "x", "max_tokens": 2}
            assert httpx.post(f"{url}/v1/completions", json=body).status_code == 404
            load = {"lora_name": "three", "lora_path": str(adapters[2][0])}
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 404
        options = ServerOptions(lora_modules=modules, allow_runtime_lora_updating=True)
        with running(build_app(llm, "base", options=options)) as url:
            answer = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
            assert answer.status_code == 200 and "three" in answer.text
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 400
            bad = {"lora_name": "four", "lora_path": "/no/such/folder"}
            answer = httpx.post(f"{url}/v1/load_lora_adapter", json=bad)
            assert answer.status_code == 400 and "adapter_config.json" in answer.text
            for bad, param in [
                ({"lora_name": "\udcff", "lora_path": load["lora_path"]}, "lora_name"),
                ({"lora_name": "four", "lora_path": "\udcff"}, "lora_path"),
                ({"lora_name": "four", "lora_path": "a" * 300}, "lora_path"),  # ENAMETOOLONG
                ({"lora_name": "", "lora_path": load["lora_path"]}, "lora_name"),
            ]:
                content = json.dumps(bad)  # escapes a lone surrogate, as JSON may
                answer = httpx.post(f"{url}/v1/load_lora_adapter", content=content, headers=JSON)
                assert answer.status_code == 400 and answer.json()["error"]["param"] == param
            content = json.dumps({"lora_name": "\udcff"})
            answer = httpx.post(f"{url}/v1/unload_lora_adapter", content=content, headers=JSON)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora_name"
            assert "three" in [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]]
            body = {"model": "three", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            answer = httpx.post(f"{url}/v1/completions", json=body).json()
            assert answer["choices"][0]["token_ids"] == transformers_greedy(
                adapters[2][1], PROMPTS[1]
            )
            beams = {"model": "three", "prompt": PROMPTS[1], "max_tokens": 4, "n": 2,
                     "use_beam_search": True, "ignore_eos": True}  # fmt: skip
            answer = httpx.post(f"{url}/v1/completions", json=beams).json()
            texts = [choice["text"] for choice in answer["choices"]]
            assert all(t and b.text.endswith(t) for b, t in zip(want.sequences, texts, strict=True))
            unload = {"lora_name": "three"}
            assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload).status_code == 200
            assert httpx.post(f"{url}/v1/completions", json=body).status_code == 404
            assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload).status_code == 404
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_modules(["one=/x"], False)
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_modules(["one"], True)


def test_adapters_loaded_side_by_side_each_take_an_id_and_bad_modules_stop_the_start(
    lora_models, tmp_path
):
    """Four loads at once (as an RL trainer's gather sends them) all succeed, each adapter
    under an id of its own; a --lora-modules adapter the engine cannot run stops the server's
    start, as vLLM's static adapters do, instead of being listed."""
    base, adapters = lora_models("llama")
    llm = AsyncLLM.from_model(str(base), max_model_len=64, enable_lora=True, max_loras=2)
    options = ServerOptions(allow_runtime_lora_updating=True)

    async def load_all(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(
                client.post("/v1/load_lora_adapter", json={
                    "lora_name": f"l{i}", "lora_path": str(adapters[1 + i % 2][0])
                }) for i in range(4)
            ))  # fmt: skip

    try:
        with running(build_app(llm, "base", options=options)) as url:
            answers = asyncio.run(load_all(url))
            assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
            for i in range(4):
                body = {"model": f"l{i}", "prompt": PROMPTS[1], "max_tokens": 12,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                got = httpx.post(f"{url}/v1/completions", json=body).json()
                want = transformers_greedy(adapters[1 + i % 2][1], PROMPTS[1])
                assert got["choices"][0]["token_ids"] == want
        high = make_tiny_lora(tmp_path / "high", base, rank=32)
        for module, message in [
            (LoRARequest("gone", 1, str(tmp_path / "none")), "adapter_config.json"),
            (LoRARequest("high", 1, str(high)), "max_lora_rank"),
            (LoRARequest("long", 1, "a" * 300), "long"),  # ENAMETOOLONG: a ValueError too
        ]:
            with pytest.raises(ValueError, match=message):
                build_app(llm, "base", options=ServerOptions(lora_modules=(module,)))
    finally:
        llm.shutdown()


def test_beam_search_and_loglikelihood_run_under_adapters(lora_models):
    """Each prompt's beams, and each pair's log-likelihood, under its adapter: those of the
    model with that adapter merged in (the merged folder, adapters off)."""
    base, adapters = lora_models("llama")
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    folders = [adapters[1][1], base, adapters[2][1]]
    wanted = [
        alone(f, "beam_search", [p], params)[0] for f, p in zip(folders, PROMPTS, strict=False)
    ]
    ends = [" the end", " more"]
    merged = alone(adapters[2][1], "loglikelihood", PROMPTS[:2], ends)
    plain = alone(base, "loglikelihood", PROMPTS[:2], ends)
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2)
    loras = [request_of(adapters, 1), None, request_of(adapters, 2)]
    got = llm.beam_search(PROMPTS[:3], params, lora_request=loras)
    for out, want in zip(got, wanted, strict=True):
        assert [b.tokens for b in out.sequences] == [b.tokens for b in want.sequences]
    # vLLM's order: prompts, params, lora_request, use_tqdm, concurrency_limit
    again = llm.beam_search(PROMPTS[:3], params, loras, False, 1)
    assert [[b.tokens for b in o.sequences] for o in again] == [
        [b.tokens for b in o.sequences] for o in wanted
    ]
    scored = llm.loglikelihood(PROMPTS[:2], ends, lora_request=request_of(adapters, 2))
    for a, b, c in zip(scored, merged, plain, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.logprob != pytest.approx(
            c.logprob
        )


def test_an_adapter_of_adapter_model_bin_named_by_a_path_gives_the_safetensors_tokens(
    lora_models, tmp_path
):
    """PEFT's older adapter_model.bin, read as vLLM reads it (torch.load of tensors only), and
    a lora_path given as a pathlib.Path (vLLM's: any path-like), kept as a str."""
    base, adapters = lora_models("llama")
    folder, merged = adapters[2]
    pickled = tmp_path / "bin"
    pickled.mkdir()
    shutil.copy(folder / "adapter_config.json", pickled)
    torch.save(load_file(folder / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    lora = LoRARequest("bin", 3, pickled)
    assert lora.lora_path == str(pickled)
    llm = LLM(str(base), max_model_len=64, enable_lora=True, max_loras=2)
    got = tokens(llm.generate(PROMPTS[:2], GREEDY, False, lora))
    want = tokens(llm.generate(PROMPTS[:2], GREEDY, False, LoRARequest("st", 4, str(folder))))
    assert got == want == [transformers_greedy(merged, p) for p in PROMPTS[:2]]
    torch.save({"lora_A": [1, 2]}, pickled / "adapter_model.bin")
    with pytest.raises(ValueError, match="no state dict of tensors"):
        llm.generate(PROMPTS[0], GREEDY, False, LoRARequest("not-tensors", 5, pickled))


def test_vllm_s_environment_variable_serves_the_runtime_adapter_routes(lora_models, monkeypatch):
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING, read as vLLM reads it ("1" or "true", any case), turns
    the load and unload routes on as --allow-runtime-lora-updating does."""
    base, adapters = lora_models("llama")
    llm = AsyncLLM.from_model(str(base), max_model_len=64, enable_lora=True)
    load = {"lora_name": "two", "lora_path": str(adapters[2][0])}
    try:
        for value, status in (("0", 404), ("yes", 404), ("True", 200), ("1", 200)):
            monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
            args = build_parser().parse_args(["serve", str(base), "--enable-lora"])
            options = server_options(args, ())
            with TestClient(build_app(llm, "base", options=options)) as client:
                assert client.post("/v1/load_lora_adapter", json=load).status_code == status
    finally:
        llm.shutdown()


def test_load_inplace_replaces_an_adapter_for_new_requests_while_running_ones_keep_theirs(
    lora_models,
):
    """vLLM's load_inplace: the name's new weights serve the requests that come after; a stream
    already running under the old adapter ends under it. Without it a loaded name is a 400."""
    base, adapters = lora_models("llama")
    llm = AsyncLLM.from_model(str(base), max_model_len=64, enable_lora=True, max_loras=2)
    options = ServerOptions(allow_runtime_lora_updating=True)
    body = {"model": "two", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    old = {"lora_name": "two", "lora_path": str(adapters[2][0])}
    new = {"lora_name": "two", "lora_path": str(adapters[1][0]), "load_inplace": True}
    try:
        with running(build_app(llm, "base", options=options)) as url:
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=old).status_code == 200
            old_text = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
            refused = httpx.post(f"{url}/v1/load_lora_adapter", json={**new, "load_inplace": False})
            assert refused.status_code == 400 and "already been loaded" in refused.text
            texts = []
            stream = {**body, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=stream, timeout=60) as events:
                for line in events.iter_lines():
                    if line.startswith("data: {"):
                        texts.append(json.loads(line[6:])["choices"][0]["text"])
                        if len(texts) == 1:  # running: replace its adapter now
                            loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=new)
                            assert loaded.status_code == 200, loaded.text
            assert "".join(texts) == old_text
            body |= {"max_tokens": 12, "return_token_ids": True}
            answer = httpx.post(f"{url}/v1/completions", json=body).json()
            assert answer["choices"][0]["token_ids"] == transformers_greedy(
                adapters[1][1], PROMPTS[1]
            )
            cards = httpx.get(f"{url}/v1/models").json()["data"]
            assert [c["id"] for c in cards] == ["base", "two"]
            base_name = {**new, "lora_name": "base"}  # the served model is no adapter
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=base_name).status_code == 400
    finally:
        llm.shutdown()
