"""tandem on Ray, with a local Ray of two CPUs shared by every test here.

Ray Data over two engine actors must give what one in-process engine gives for the same seeds:
greedy outputs do not depend on the batch, and seeded sampling does not depend on what else runs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray.data")
pytest.importorskip("ray.serve")

import ray
import ray.data

from tandem import LLM, SamplingParams
from tandem.ray import generate

ENGINE_ARGS = {"max_model_len": 256, "block_size": 8, "num_blocks": 128, "device": "cpu"}
RUN_BATCH_ARGS = {"max_model_len": 256, "block_size": 8, "num_blocks": 128, "max_num_seqs": 4}
PROMPTS = ["The engine", "Once upon a time", "café au lait", "KV blocks", "A scheduler", "Ray"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def row_params(i: int) -> dict:
    if i % 2 == 0:
        return {"max_tokens": 12, "temperature": 0.0}
    return {"max_tokens": 10 + i, "temperature": 0.8, "top_k": 20, "seed": 1000 + i}


def test_ray_data_over_two_actors_matches_one_engine(local_ray, folder):
    rows = [{"prompt": p, "sampling_params": row_params(i)} for i, p in enumerate(PROMPTS)]
    rows.append(
        {
            "prompt_token_ids": [5, 6, 7, 8],
            "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 2},
        }
    )
    rows.append({"prompt": "bad", "sampling_params": {"temperature": -1.0}})
    rows.append({"prompt": "bad", "sampling_params": {"tempreature": 1.0}})
    ds = ray.data.from_items(rows, override_num_blocks=4)
    out = generate(ds, folder, concurrency=2, batch_size=2, **ENGINE_ARGS).take_all()
    assert len(out) == len(rows)

    llm = LLM(folder, **ENGINE_ARGS)
    good = rows[: len(PROMPTS) + 1]
    prompts = [r.get("prompt") or {"prompt_token_ids": r["prompt_token_ids"]} for r in good]
    params = [SamplingParams(**r["sampling_params"]) for r in good]
    expected = llm.generate(prompts, params, use_tqdm=False)
    by_prompt = {}
    for row in out:
        key = (
            row["prompt"] if row.get("prompt_token_ids") is None else tuple(row["prompt_token_ids"])
        )
        by_prompt.setdefault(key, []).append(row)
    for r, want in zip(good, expected, strict=True):
        key = r["prompt"] if "prompt" in r else tuple(r["prompt_token_ids"])
        (got,) = by_prompt[key]
        completion = want.outputs[0]
        assert got["error"] is None
        assert list(got["generated_token_ids"]) == completion.token_ids
        assert got["generated_text"] == completion.text
        assert got["finish_reason"] == completion.finish_reason
        assert got["num_prompt_tokens"] == len(want.prompt_token_ids)
    (with_logprobs,) = by_prompt[(5, 6, 7, 8)]
    want_logprobs = expected[-1].outputs[0].logprobs
    assert [list(e["token_ids"]) for e in with_logprobs["logprobs"]] == [
        list(e) for e in want_logprobs
    ]
    bad = by_prompt["bad"]
    assert sorted(b["error"].split(" ")[0] for b in bad) == ["sampling_params:", "temperature"]
    assert all(b["generated_token_ids"] is None for b in bad)


# ---- tandem run-batch --data-parallel-size 2 ------------------------------------------------


def test_run_batch_over_two_engines_resumes_and_answers_every_line_once(
    local_ray, folder, tmp_path
):
    from tandem.run_batch import run_batch
    from test_run_batch import MODEL, check_answers, interrupted_copy, read_output, write_batch

    batch = write_batch(tmp_path / "requests.jsonl")
    engine_args = {**RUN_BATCH_ARGS, "device": "cpu"}  # 4 seqs: batches of one request
    one = tmp_path / "one.jsonl"
    run_batch(str(batch), str(one), folder, engine_args, 1, MODEL, quiet=True)
    out = tmp_path / "two.jsonl"
    kept = interrupted_copy(one, out, num_kept=3)
    run_batch(str(batch), str(out), folder, engine_args, 2, MODEL, quiet=True)
    lines = read_output(out)
    check_answers(lines, folder)
    assert [line["id"] for line in lines[:2]] == [line["id"] for line in kept[1:]]
