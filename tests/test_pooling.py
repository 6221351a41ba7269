"""Embeddings (LLM.embed, pooling.py): each prompt's last token's final hidden state, against
transformers' base model, L2-normalized or not, truncated to `dimensions`; beside generation,
with chunked prefill, the prefix cache, preemption, sync and async, two ranks; bad input."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem import LLM, PoolingParams, SamplingParams
from tandem.pooling import PoolingBuffers, plan_rows
from tandem.request import Request

PROMPTS = ["Hello there", "Paged attention is neat", "café au lait " * 5, "The quick brown fox"]


@pytest.fixture(scope="module")
def folder(make_tiny, tmp_path_factory) -> str:
    """The tiny Llama marked Matryoshka (config.json's is_matryoshka), so `dimensions` apply."""
    return str(
        with_config(make_tiny("llama"), tmp_path_factory.mktemp("m") / "m", is_matryoshka=True)
    )


def with_config(source, folder, **fields) -> Path:
    """A copy of the checkpoint `source` with these config.json fields set."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


@cache
def reference(folder: str, ids: tuple[int, ...]) -> np.ndarray:
    """transformers' base model: the last token's final hidden state (after the last norm)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()


def normalized(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def assert_embeds(folder: str, outs, normalize: bool = True, dimensions: int | None = None):
    """Each output against transformers: normalized (vLLM's use_activation) or not."""
    for out in outs:
        want = reference(folder, tuple(out.prompt_token_ids))[:dimensions]
        want = normalized(want) if normalize else want
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "engine_args",
    [{}, {"async_batching": False}, {"max_num_batched_tokens": 5}],  # chunks of 5 tokens
    ids=["async", "sync", "chunked"],
)
def test_embeddings_are_the_last_token_s_normalized_hidden_state(make_tiny, arch, engine_args):
    folder = str(make_tiny(arch))
    llm = LLM(folder, max_model_len=64, **engine_args)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert [o.outputs.hidden_size for o in outs] == [llm.engine.model_config.hidden_size] * 4
    assert_embeds(folder, outs)
    assert all(abs(np.linalg.norm(o.outputs.embedding) - 1) < 1e-6 for o in outs)
    assert not llm.engine.has_unfinished()


def test_use_activation_false_and_dimensions(folder, make_tiny, tmp_path):
    llm = LLM(folder, max_model_len=64)
    raw = llm.embed(PROMPTS[:2], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    assert_embeds(folder, raw, normalize=False)
    per_prompt = [PoolingParams(dimensions=16), PoolingParams(dimensions=8, use_activation=False)]
    short = llm.embed(PROMPTS[:2], pooling_params=per_prompt, use_tqdm=False)
    assert_embeds(folder, short[:1], dimensions=16)
    assert_embeds(folder, short[1:], normalize=False, dimensions=8)
    # as vLLM: dimensions only where the model is Matryoshka, and among its own where it lists them
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        LLM(str(make_tiny("llama")), max_model_len=64).embed(
            PROMPTS[:1], pooling_params=PoolingParams(dimensions=16)
        )
    listed = str(with_config(Path(folder), tmp_path / "listed", matryoshka_dimensions=[8, 16]))
    llm = LLM(listed, max_model_len=64)
    assert_embeds(folder, llm.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=8)),
                  dimensions=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"Matryoshka dimensions \[8, 16\], got dimensions=12"):
        llm.embed(PROMPTS[:1], pooling_params=PoolingParams(dimensions=12))


def st_folder(source: str, folder: Path, modules: list[tuple[str, str]], mode: str) -> Path:
    """A copy of `source` as a sentence-transformers model: modules.json's (type, path) list,
    its Pooling module's config pooling by `mode`."""
    shutil.copytree(source, folder)
    entries = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{t}"}
               for i, (t, path) in enumerate(modules)]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(entries))
    for kind, path in modules:
        if kind == "Pooling":
            (folder / path).mkdir()
            (folder / path / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))
    return folder


def test_a_sentence_transformers_model_normalizes_only_with_its_normalize_module(folder, tmp_path):
    """vLLM reads modules.json: without a Normalize module the vectors are the raw states."""
    plain = [("Transformer", ""), ("Pooling", "1_Pooling")]
    for modules, normalize in ((plain, False), ([*plain, ("Normalize", "2_Normalize")], True)):
        st = st_folder(folder, tmp_path / str(normalize), modules, "lasttoken")
        outs = LLM(str(st), max_model_len=64).embed(PROMPTS[:2], use_tqdm=False)
        assert_embeds(folder, outs, normalize=normalize)
    # its Pooling module where modules.json puts it, not only 1_Pooling
    mean = st_folder(
        folder, tmp_path / "mean", [("Transformer", ""), ("Pooling", "1_Pool")], "mean_tokens"
    )
    with pytest.raises(ValueError, match=r"pooling_mode_mean_tokens \(its 1_Pool/config.json\)"):
        LLM(str(mean), max_model_len=64).embed(PROMPTS[:1], use_tqdm=False)
    # a Dense projection after the pooling (vLLM's and sentence-transformers' apply it) would
    # be skipped: refused, naming it, while the model still generates
    dense = st_folder(
        folder, tmp_path / "dense",
        [("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense"), ("Normalize", "3")],
        "lasttoken",
    )  # fmt: skip
    llm = LLM(str(dense), max_model_len=64)
    with pytest.raises(ValueError, match=r"sentence_transformers\.models\.Dense"):
        llm.embed(PROMPTS[:1], use_tqdm=False)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)


def test_vllms_pooling_params_truncate_prompt_tokens_and_normalize(folder):
    """PoolingParams(truncate_prompt_tokens=k) keeps the first k tokens (vLLM's side for
    pooling) as the call's argument does; normalize=False (use_activation's older name) gives
    the raw states."""
    llm = LLM(folder, max_model_len=64)
    prompt = {"prompt_token_ids": list(range(3, 23))}
    [cut] = llm.embed(prompt, pooling_params=PoolingParams(truncate_prompt_tokens=5))
    [short] = llm.embed({"prompt_token_ids": list(range(3, 8))})
    assert cut.prompt_token_ids == list(range(3, 8)) and cut.outputs.embedding == pytest.approx(
        short.outputs.embedding, abs=1e-5
    )
    with pytest.raises(ValueError, match="truncate_prompt_tokens is 4 in the call but 5"):
        llm.embed(prompt, pooling_params=PoolingParams(truncate_prompt_tokens=5),
                  truncate_prompt_tokens=4)  # fmt: skip
    raw = llm.embed(PROMPTS[:2], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert_embeds(folder, raw, normalize=False)
    with pytest.raises(ValueError, match="older name"):
        llm.embed(PROMPTS[:1], pooling_params=PoolingParams(normalize=False, use_activation=True))


def test_embeddings_run_beside_generation_and_leave_its_tokens_alone(folder):
    llm = LLM(folder, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    ids = llm.enqueue(PROMPTS, params)  # generations in flight while the embeddings step
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert_embeds(folder, outs)
    done = {o.request_id: o.outputs[0].token_ids for o in llm.wait_for_completion(use_tqdm=False)}
    assert [done[i] for i in ids] == alone


def test_tokenization_kwargs_cut_pooled_prompts_as_truncate_prompt_tokens_does(folder):
    """vLLM's `tokenization_kwargs={"truncate_prompt_tokens": k}` on embed, encode and score:
    the vectors of the prompts' first k tokens (vLLM's side for pooling)."""
    llm = LLM(folder, max_model_len=64, block_size=8)
    prompt = {"prompt_token_ids": list(range(10, 30))}
    kwargs = {"tokenization_kwargs": {"truncate_prompt_tokens": 4}}
    [by_argument] = llm.embed(prompt, truncate_prompt_tokens=4, use_tqdm=False)
    [by_kwargs] = llm.embed(prompt, use_tqdm=False, **kwargs)
    [first] = llm.embed({"prompt_token_ids": list(range(10, 14))}, use_tqdm=False)
    assert by_kwargs.outputs.embedding == by_argument.outputs.embedding
    assert by_kwargs.outputs.embedding == first.outputs.embedding
    [encoded] = llm.encode(prompt, use_tqdm=False, pooling_task="embed", **kwargs)
    assert encoded.outputs.data.tolist() == first.outputs.embedding
    with pytest.raises(ValueError, match="give one"):
        llm.embed(prompt, truncate_prompt_tokens=3, use_tqdm=False, **kwargs)


def test_a_cached_prompt_gives_the_same_embedding(folder):
    llm = LLM(folder, max_model_len=64, block_size=4)
    prompt = {"prompt_token_ids": list(range(3, 30))}
    first, second = (llm.embed(prompt, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 24  # 6 full blocks
    np.testing.assert_allclose(second.outputs.embedding, first.outputs.embedding, atol=1e-6)
    assert_embeds(folder, [second])


def test_embeddings_through_preemption(folder):
    llm = LLM(folder, max_model_len=96, num_blocks=14, block_size=8)
    generate = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.enqueue(["A long story begins " * 3] * 3, generate)
    outs = llm.embed([{"prompt_token_ids": list(range(5, 5 + n))} for n in (30, 45, 20)])
    assert_embeds(folder, outs)
    llm.wait_for_completion(use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0


def test_two_ranks_embed_as_one(folder):
    one = LLM(folder, max_model_len=64).embed(PROMPTS, use_tqdm=False)
    llm = LLM(folder, max_model_len=64, tensor_parallel_size=2)
    try:
        two = llm.embed(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()  # its process group: one open at a time in a process
    for a, b in zip(one, two, strict=True):
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5)


def test_plan_rows_take_each_sampling_pooling_request_s_last_token_row(folder):
    """Request 0 (3 tokens) pools its last, request 1 generates, request 2 (4 tokens) is
    mid-prompt (no sample), request 3 (2 tokens) pools: token rows 2 and 9."""
    requests = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=1), 0) for i in range(4)]
    for i in (0, 2, 3):
        requests[i].pooling = PoolingParams()
    buffers = PoolingBuffers(8, 4, torch.device("cpu"))
    step = plan_rows(requests, np.array([0, 3]), np.array([0, 3, 4, 8, 10]), buffers)
    assert step.requests == [requests[0], requests[3]]
    assert buffers.np_rows[:2].tolist() == [2, 9]
    # the builder's choice of those rows: pooling requests' rows that sample, none otherwise
    llm = LLM(folder, max_model_len=64)
    builder = llm.engine.builder
    rows = builder.running_rows.rows(requests)
    samples = np.array([True, True, False, True])
    assert np.flatnonzero(builder.running_rows.pooled[rows] & samples).tolist() == [0, 3]


@pytest.mark.parametrize(
    ("pooling", "words"),
    [
        (PoolingParams(dimensions=65), "more than the model's 64"),
        (PoolingParams(dimensions=0), "dimensions"),
        (PoolingParams(use_activation="yes"), "use_activation"),
        # another call's task (vLLM's "cannot overwrite"), or none: replaced by "embed" before
        (PoolingParams(task="classify"), "pooling_params.task is 'classify', but this call pools"),
        (PoolingParams(task="zzz"), "pooling_params.task is 'zzz'"),
    ],
)
def test_bad_pooling_params_are_value_errors_that_queue_nothing(folder, pooling, words):
    llm = LLM(folder, max_model_len=64)
    with pytest.raises(ValueError, match=words):
        llm.embed(PROMPTS[:2], pooling_params=[PoolingParams(), pooling])
    assert not llm.engine.has_unfinished()


def test_other_bad_calls(folder):
    llm = LLM(folder, max_model_len=64)
    with pytest.raises(ValueError, match="2 pooling_params for 3 prompts"):
        llm.embed(PROMPTS[:3], pooling_params=[PoolingParams()] * 2)
    with pytest.raises(TypeError, match="PoolingParams"):
        llm.embed(PROMPTS[:1], pooling_params=[{"use_activation": False}])
    with pytest.raises(TypeError, match="lora_request"):
        llm.embed(PROMPTS[:1], lora_request=object())
    assert len(llm.embed([], use_tqdm=False)) == 0


@pytest.mark.parametrize(("mode", "refused"), [("pooling_mode_lasttoken", False),
                                               ("pooling_mode_mean_tokens", True)])  # fmt: skip
def test_a_sentence_transformers_model_that_pools_otherwise_is_refused(
    folder, tmp_path, mode, refused
):
    model = Path(shutil.copytree(folder, tmp_path / "model"))
    (model / "1_Pooling").mkdir()
    modes = {"pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": False, mode: True}
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                 **modes}))  # fmt: skip
    llm = LLM(str(model), max_model_len=64)
    if refused:
        with pytest.raises(ValueError, match="pooling_mode_mean_tokens"):
            llm.embed(PROMPTS[:1], use_tqdm=False)
        assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    else:
        assert_embeds(folder, llm.embed(PROMPTS[:1], use_tqdm=False))


def test_an_embedding_aborted_mid_prompt_comes_back_unfinished(folder):
    """As a pause's abort ends it: no vector, finished False; the engine goes on."""
    llm = LLM(folder, max_model_len=64, max_num_batched_tokens=8)  # its prompt takes 5 steps
    step = llm.engine.step

    def step_then_abort():
        updated = step()
        for request_id in list(llm.engine.requests):
            llm.engine.abort(request_id)
        return updated

    llm.engine.step = step_then_abort
    [out] = llm.embed({"prompt_token_ids": list(range(3, 40))}, use_tqdm=False)
    assert out.outputs.embedding is None and not out.finished
    llm.engine.step = step
    assert_embeds(folder, llm.embed(PROMPTS[:1], use_tqdm=False))


@pytest.fixture(scope="module")
def classifiers(make_tiny, tmp_path_factory) -> dict[int, tuple[str, torch.nn.Module]]:
    """Tiny LlamaForSequenceClassification checkpoints of 3 labels and of 1 (a reward model),
    written by transformers, with the tiny Llama's tokenizer: labels -> (folder, the model)."""
    from transformers import AutoConfig, LlamaForSequenceClassification

    base = make_tiny("llama")
    made = {}
    for num_labels in (3, 1):
        config = AutoConfig.from_pretrained(base)
        config.num_labels, config.architectures = num_labels, ["LlamaForSequenceClassification"]
        torch.manual_seed(num_labels)
        model = LlamaForSequenceClassification(config).eval()
        folder = tmp_path_factory.mktemp(f"classifier-{num_labels}")
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(base / name, folder / name)
        made[num_labels] = (str(folder), model)
    return made


def transformers_scores(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():  # the last token's (the prompts hold no pad token)
        return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 5}], ids=["", "chunked"])
def test_classify_gives_the_score_head_s_softmax_at_the_last_token(classifiers, engine_args):
    folder, model = classifiers[3]
    llm = LLM(folder, max_model_len=64, **engine_args)
    assert llm.engine.model_config.num_labels == 3
    for out in llm.classify(PROMPTS, use_tqdm=False):
        logits = transformers_scores(model, out.prompt_token_ids)
        want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(out.outputs.probs, want, rtol=1e-4, atol=1e-6)
        assert out.outputs.num_classes == 3 and out.finished
    raw = llm.classify(PROMPTS[:1], pooling_params=PoolingParams(use_activation=False))[0]
    want = transformers_scores(model, raw.prompt_token_ids)
    np.testing.assert_allclose(raw.outputs.probs, want, rtol=1e-4, atol=1e-5)


def test_a_one_label_reward_model_gives_the_sigmoid_of_its_score(classifiers):
    folder, model = classifiers[1]
    llm = LLM(folder, max_model_len=64)
    for out in llm.classify(PROMPTS, use_tqdm=False):
        [score] = transformers_scores(model, out.prompt_token_ids)
        np.testing.assert_allclose(out.outputs.probs, [1 / (1 + np.exp(-score))], rtol=1e-4)


@pytest.mark.parametrize(
    ("labels", "problem_type", "activation"),
    [
        (3, "multi_label_classification", lambda x: 1 / (1 + np.exp(-x))),  # each label alone
        (3, "single_label_classification", lambda x: np.exp(x) / np.exp(x).sum()),
        (1, "regression", lambda x: x),  # a reward model's raw score
    ],
)
def test_classify_applies_the_activation_config_json_s_problem_type_names(
    classifiers, tmp_path, labels, problem_type, activation
):
    """vLLM's: regression none, multi-label a sigmoid per label, otherwise softmax (sigmoid
    for one label)."""
    source, model = classifiers[labels]
    folder = with_config(Path(source), tmp_path / "c", problem_type=problem_type)
    for out in LLM(str(folder), max_model_len=64).classify(PROMPTS[:2], use_tqdm=False):
        want = activation(transformers_scores(model, out.prompt_token_ids))
        np.testing.assert_allclose(out.outputs.probs, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("named", "activation"),
    [
        ("torch.nn.modules.linear.Identity", lambda x: x),
        ("torch.nn.modules.activation.Tanh", np.tanh),
        (None, lambda x: 1 / (1 + np.exp(-x))),  # none named: classify's
    ],
)
def test_a_cross_encoder_scores_through_the_activation_sentence_transformers_names(
    classifiers, tmp_path, named, activation
):
    source, model = classifiers[1]
    fields = {"sentence_transformers": {"activation_fn": named}} if named else {}
    llm = LLM(str(with_config(Path(source), tmp_path / "ce", **fields)), max_model_len=64)
    [out] = llm.score(PROMPTS[0], PROMPTS[1], use_tqdm=False)
    [logit] = transformers_scores(model, out.prompt_token_ids)
    assert out.outputs.score == pytest.approx(activation(logit), rel=1e-4, abs=1e-6)
    [probs] = llm.classify(PROMPTS[:1], use_tqdm=False)  # classify keeps its own activation
    [logit] = transformers_scores(model, probs.prompt_token_ids)
    assert probs.outputs.probs[0] == pytest.approx(1 / (1 + np.exp(-logit)), rel=1e-4)


def test_an_activation_fn_tandem_does_not_apply_is_a_value_error_for_scores(classifiers, tmp_path):
    fields = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.GELU"}}
    folder = with_config(Path(classifiers[1][0]), tmp_path / "gelu", **fields)
    llm = LLM(str(folder), max_model_len=64)
    with pytest.raises(ValueError, match="GELU"):
        llm.score(PROMPTS[0], PROMPTS[1], use_tqdm=False)
    assert llm.classify(PROMPTS[:1], use_tqdm=False)[0].outputs.probs  # classify still answers


def test_classifiers_and_generators_each_refuse_the_other_s_calls(classifiers, folder):
    classifier = LLM(classifiers[3][0], max_model_len=64)
    with pytest.raises(ValueError, match=r"LLM\.classify"):
        classifier.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        classifier.classify(PROMPTS[:1], pooling_params=PoolingParams(dimensions=4))
    assert classifier.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.hidden_size == 64
    with pytest.raises(ValueError, match="sequence classifier"):
        LLM(folder, max_model_len=64).classify(PROMPTS[:1])
    assert not classifier.engine.has_unfinished()


def test_the_server_s_classify_route_answers_what_llm_classify_does(classifiers, folder):
    import httpx

    from tandem.async_llm import AsyncLLM
    from tandem.server.app import build_app
    from test_server import running

    classifier, _ = classifiers[3]
    want = LLM(classifier, max_model_len=64).classify(PROMPTS[:2], use_tqdm=False)
    for model, served in ((classifier, True), (folder, False)):
        llm = AsyncLLM.from_model(model, max_model_len=64)
        try:
            with running(build_app(llm, "m")) as url:
                response = httpx.post(f"{url}/classify", json={"input": PROMPTS[:2]})
                if not served:  # a generative model: a 400 saying why
                    assert response.status_code == 400
                    assert "sequence classifier" in response.json()["error"]["message"]
                    continue
                body = response.json()
                assert [d["index"] for d in body["data"]] == [0, 1] and body["model"] == "m"
                for got, out in zip(body["data"], want, strict=True):
                    np.testing.assert_allclose(got["probs"], out.outputs.probs, atol=1e-6)
                    assert got["label"] == f"LABEL_{int(np.argmax(out.outputs.probs))}"
                    assert got["num_classes"] == 3
                tokens = sum(len(out.prompt_token_ids) for out in want)
                assert body["usage"]["prompt_tokens"] == tokens
        finally:
            llm.shutdown()


def test_encode_pools_as_the_task_says_into_tensors(classifiers, folder):  # vLLM's LLM.encode
    llm = LLM(folder, max_model_len=64)
    embedded = llm.embed(PROMPTS[:2], use_tqdm=False)
    for task in (None, "embed"):
        encoded = llm.encode(PROMPTS[:2], pooling_task=task, use_tqdm=False)
        for out, want in zip(encoded, embedded, strict=True):
            assert out.outputs.data.dtype == torch.float32
            np.testing.assert_allclose(out.outputs.data.numpy(), want.outputs.embedding, rtol=1e-6)
            assert out.prompt_token_ids == want.prompt_token_ids and out.finished
    short = llm.encode(PROMPTS[:1], PoolingParams(dimensions=8), use_tqdm=False)[0]
    assert short.outputs.data.shape == (8,)
    for task, match in (("classify", "sequence classifier"), ("token_embed", "pooling_task")):
        with pytest.raises(ValueError, match=match):
            llm.encode(PROMPTS[:1], pooling_task=task, use_tqdm=False)
    classifier = LLM(classifiers[3][0], max_model_len=64)
    want = classifier.classify(PROMPTS[:2], use_tqdm=False)
    for out, expected in zip(classifier.encode(PROMPTS[:2], use_tqdm=False), want, strict=True):
        np.testing.assert_allclose(out.outputs.data.numpy(), expected.outputs.probs, rtol=1e-6)


def test_the_server_s_pooling_route_answers_what_embed_and_classify_do(classifiers, folder):
    import base64

    import httpx

    from tandem.async_llm import AsyncLLM
    from tandem.server.app import build_app
    from test_server import running

    for model, wanted in (
        (folder, [o.outputs.embedding for o in LLM(folder, max_model_len=64).embed(PROMPTS[:2])]),
        (
            classifiers[3][0],
            [
                o.outputs.probs
                for o in LLM(classifiers[3][0], max_model_len=64).classify(PROMPTS[:2])
            ],
        ),
    ):
        llm = AsyncLLM.from_model(model, max_model_len=64)
        try:
            with running(build_app(llm, "m")) as url:
                body = httpx.post(f"{url}/pooling", json={"input": PROMPTS[:2]}).json()
                assert [d["object"] for d in body["data"]] == ["pooling"] * 2
                for got, want in zip(body["data"], wanted, strict=True):
                    np.testing.assert_allclose(got["data"], want, rtol=1e-6)
                raw = httpx.post(
                    f"{url}/pooling", json={"input": PROMPTS[:1], "encoding_format": "base64"}
                ).json()["data"][0]["data"]
                decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
                np.testing.assert_allclose(decoded, wanted[0], rtol=1e-6)
                if model == folder:  # a generative model has no classes
                    answer = httpx.post(f"{url}/pooling", json={"input": "x", "task": "classify"})
                    assert answer.status_code == 400
                    assert "sequence classifier" in answer.json()["error"]["message"]
        finally:
            llm.shutdown()


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 8}], ids=["", "chunked"])
def test_a_pooled_prompt_may_fill_max_model_len(folder, engine_args):
    """As vLLM: pooling samples no token, so a prompt of max_model_len tokens is embedded, and
    truncate_prompt_tokens=-1 keeps that many; one more is a ValueError."""
    llm = LLM(folder, max_model_len=32, block_size=8, **engine_args)
    ids = list(range(10, 42))  # 32 tokens
    [full] = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    assert_embeds(folder, [full])
    [cut] = llm.embed({"prompt_token_ids": [*ids, 5]}, truncate_prompt_tokens=-1, use_tqdm=False)
    assert cut.prompt_token_ids == ids
    with pytest.raises(ValueError, match="at most 32 tokens"):
        llm.embed({"prompt_token_ids": [5, *ids]}, use_tqdm=False)
    with pytest.raises(ValueError, match="at most 31 tokens"):  # a generation needs a token's room
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_modules_json_decides_normalization_only_with_a_pooling_module(folder, tmp_path):
    """As vLLM: without a Pooling module modules.json says nothing of it (normalized); one
    that is no list refuses embeddings alone, and the model still generates."""
    bare = st_folder(folder, tmp_path / "bare", [("Transformer", "")], "lasttoken")
    assert_embeds(folder, LLM(str(bare), max_model_len=64).embed(PROMPTS[:1], use_tqdm=False))
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    (broken / "modules.json").write_text("{}")
    llm = LLM(str(broken), max_model_len=64)
    with pytest.raises(ValueError, match=r"modules\.json must hold a JSON list"):
        llm.embed(PROMPTS[:1], use_tqdm=False)
    params = SamplingParams(max_tokens=2)
    assert len(llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
