"""lm-evaluation-harness end to end, against `tandem serve` and on the offline engine (its model
"tandem", tandem/evaluation.py), on the tiny model, with the local tasks
of tests/lm_eval_tasks (JSON lines + task YAML, no hub): its loglikelihoods (echo + logprobs,
the multiple_choice task) equal transformers' within 1e-4, and its generate_until task's
completions equal transformers' greedy ones."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import wait_until_healthy

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS = Path(__file__).parent / "lm_eval_tasks"
MODEL = "tiny-llama"
TOLERANCE = 1e-4


@contextmanager
def tandem_serve(folder: str) -> Iterator[str]:
    """`tandem serve` in a subprocess, on a free port; yields its URL once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tandem.cli", "serve", folder, "--port", str(port)]
    # 16-token steps: contexts are scored over several prefill chunks
    command += ["--max-model-len", "256", "--max-num-batched-tokens", "16"]
    command += ["--served-model-name", MODEL]
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        try:
            wait_until_healthy(process, url, 120)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_lm_eval_local_tasks_match_transformers(make_tiny, offline_tasks):
    folder = str(make_tiny("llama"))
    with tandem_serve(folder) as url:
        lm = LocalCompletionsAPI(
            model=MODEL,
            base_url=f"{url}/v1/completions",
            tokenizer=folder,
            num_concurrent=4,
            max_retries=1,
            max_length=256,
        )
        results = evaluate(lm)
    check_against_transformers(results, lm, folder)


def evaluate(lm, tasks=("tandem_choice", "tandem_generate"), **kwargs) -> dict:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        **kwargs,
    )


@pytest.fixture
def offline_tasks(tmp_path, monkeypatch):
    monkeypatch.chdir(TASKS)  # the task YAMLs name their data files relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def test_the_offline_tandem_model_matches_transformers(make_tiny, offline_tasks):
    from tandem.evaluation import TandemLM

    folder = str(make_tiny("llama"))
    # 16-token steps: contexts are scored over several prefill chunks
    lm = TandemLM(folder, max_model_len=256, max_num_batched_tokens=16)
    check_against_transformers(evaluate(lm), lm, folder)


def test_the_tandem_model_is_lm_evals_model_tandem_built_from_model_args(make_tiny, offline_tasks):
    import tandem.evaluation  # noqa: F401  (registers "tandem")

    folder = str(make_tiny("llama"))
    args = f"pretrained={folder},max_model_len=256,max_gen_toks=8"
    results = evaluate("tandem", tasks=["tandem_choice"], model_args=args)
    assert len(results["samples"]["tandem_choice"]) == 6
    acc = results["results"]["tandem_choice"]["acc,none"]
    # lm-eval's command line, with the model registered: the same accuracy
    command = [sys.executable, "-m", "tandem.evaluation", "run", "--model", "tandem"]
    command += ["--model_args", args, "--tasks", "tandem_choice", "--include_path", str(TASKS)]
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    [row] = [line for line in done.stdout.splitlines() if line.startswith("|tandem_choice")]
    assert f"|acc     |↑  |{acc:.4f}|" in row


def test_rolling_loglikelihood_sums_lm_evals_windows_under_transformers(make_tiny):
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from tandem.evaluation import TandemLM

    folder = str(make_tiny("llama"))
    lm = TandemLM(folder, max_model_len=24)  # windows of 22 tokens: the text takes several
    texts = ["The scheduler reads the tokens of every request, step by step, " * 3, "Hello"]
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    got = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for text, total in zip(texts, got, strict=True):
        tokens = lm.tok_encode(text)
        windows = list(map(make_disjoint_window, get_rolling_token_windows(
            token_list=tokens, prefix_token=lm.prefix_token_id, max_seq_len=22, context_len=1
        )))  # fmt: skip
        assert sum(len(cont) for _, cont in windows) == len(tokens)
        assert len(windows) >= (3 if len(tokens) > 44 else 1)
        want = 0.0
        for context, continuation in windows:
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                rows = model(ids).logits[0, len(context) - 1 : -1].log_softmax(-1)
            want += rows[torch.arange(len(continuation)), continuation].sum().item()
        assert total == pytest.approx(want, abs=TOLERANCE * len(tokens))


def test_generation_kwargs_that_are_no_sampling_fields_are_refused(make_tiny):
    from lm_eval.api.instance import Instance

    from tandem.evaluation import TandemLM

    lm = TandemLM(str(make_tiny("llama")), max_model_len=64)
    request = Instance("generate_until", {}, ("Hi", {"until": ["\n"], "num_beams": 4}), 0)
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([request], disable_tqdm=True)
    with pytest.raises(ValueError, match="max_model_len=64"):
        TandemLM(lm.llm, max_length=65)  # windows the engine could not take
    assert TandemLM(lm.llm, max_length=32).max_length == 32


def test_texts_are_encoded_as_lm_evals_models_encode_them(make_tiny):
    """lm-eval's hf and vllm models: the tokenizer's special tokens (BOS) by default, none on a
    text that begins with the BOS text (a chat template's), none under add_bos_token=False."""
    from tandem.evaluation import TandemLM

    folder = str(make_tiny("llama"))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    lm = TandemLM(folder, max_model_len=64)
    bos = reference.bos_token
    assert lm.tok_encode("Hello world") == reference("Hello world").input_ids
    templated = bos + "Hello world"  # transformers' own default would give it two
    assert lm.tok_encode(templated) == reference(templated, add_special_tokens=False).input_ids
    assert lm.tok_encode(templated).count(reference.bos_token_id) == 1
    assert (
        lm.tok_encode("Hello world", add_special_tokens=False)
        == reference("Hello world", add_special_tokens=False).input_ids
    )
    assert (
        TandemLM(lm.llm, add_bos_token=False).tok_encode("Hello world")
        == reference("Hello world", add_special_tokens=False).input_ids
    )


def test_generation_kwargs_read_as_lm_evals_vllm_model_reads_them(make_tiny):
    """do_sample false wins over a temperature (greedy, as transformers'), lm-eval's aliases of
    max_gen_toks are taken, and max_gen_toks of max_length still leaves room for the context."""
    from lm_eval.api.instance import Instance

    from tandem.evaluation import TandemLM

    folder = str(make_tiny("llama"))
    lm = TandemLM(folder, max_model_len=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([lm.tok_encode("Once upon a time")])
    greedy = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0, ids.shape[1] :]  # fmt: skip
    want = lm.tokenizer.decode(greedy)
    kwargs = [
        {"until": [], "max_gen_toks": 6, "temperature": 1, "do_sample": False},  # LongBench's
        {"until": [], "max_new_tokens": 6},
        {"until": [], "max_tokens": 6},
        {"until": [], "max_completion_tokens": 6},
    ]
    requests = [Instance("generate_until", {}, ("Once upon a time", k), 0) for k in kwargs]
    assert lm.generate_until(requests * 2, disable_tqdm=True) == [want] * 8
    long = Instance("generate_until", {}, ("Once upon a time", {"max_gen_toks": 64}), 0)
    [text] = lm.generate_until([long], disable_tqdm=True)
    assert text  # the context fits beside what is left of max_length


def check_against_transformers(results: dict, lm, folder: str) -> None:
    """Every loglikelihood of the choice task and every completion of the generate task as
    transformers gives them on the same token ids."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    choices = results["samples"]["tandem_choice"]
    assert len(choices) == 6 and "acc,none" in results["results"]["tandem_choice"]
    num_correct = 0
    for sample in choices:
        scores = []
        for (context, continuation), [(logprob, is_greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = torch.tensor([context_ids + continuation_ids])
            with torch.no_grad():
                rows = model(ids).logits[0, len(context_ids) - 1 : -1].log_softmax(-1)
            wanted = rows[torch.arange(len(continuation_ids)), continuation_ids]
            assert logprob == pytest.approx(wanted.sum().item(), abs=TOLERANCE)
            assert is_greedy == bool((rows.argmax(-1) == torch.tensor(continuation_ids)).all())
            scores.append(wanted.sum().item())
        num_correct += max(range(len(scores)), key=scores.__getitem__) == sample["target"]
    assert results["results"]["tandem_choice"]["acc,none"] == pytest.approx(num_correct / 6)

    generations = results["samples"]["tandem_generate"]
    eos = lm.tokenizer.decode(lm.eot_token_id)
    assert len(generations) == 4 and "exact_match,none" in results["results"]["tandem_generate"]
    for sample in generations:
        [(prompt, kwargs)] = sample["arguments"]
        ids = torch.tensor([lm.tok_encode(prompt)])
        greedy = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=kwargs["max_gen_toks"],
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, ids.shape[1] :]  # fmt: skip
        # lm-eval's vllm model's text: special tokens kept, cut at "\n" or the EOS text
        text = lm.tokenizer.decode(greedy).split("\n")[0].split(eos)[0]
        assert sample["resps"] == [[text]]
