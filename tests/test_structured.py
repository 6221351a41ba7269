"""Structured outputs (structured.py): constrained outputs parse, on random weights.

With random weights the model has no idea of JSON: these tests check the mechanism (every
sampled token allowed by its step's mask, the masks computed from the tokens before), not the
model. Outputs are checked by independent parsers: jsonschema, re.fullmatch, membership.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams, StructuredOutputsParams
from tandem.runner import Runner
from tandem.structured import choice_grammar, is_lark

pytest.importorskip("xgrammar")

# nested objects, arrays, enums, required and optional fields, numbers with bounds; each ends
# within a few dozen tokens of the tiny model's mostly one-character vocabulary
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
     "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
        "maximum": 120}}, "required": ["name", "age"]}, "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer",
     "minimum": 1, "maximum": 9}}, "required": ["id"]}, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
     "c": {"type": "integer", "minimum": -3, "maximum": 3}}, "required": ["a"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["x"]},
    {"enum": ["alpha", "beta", 7, None]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer",
     "minimum": -5, "maximum": 5}}, "required": ["kind", "x"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "boolean"}]},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
     "maximum": 3}, "maxItems": 2}, "maxItems": 2},
]  # fmt: skip
REGEXES = [r"\d{3}-[a-z]{2,5}", r"(yes|no|maybe)!?", r"[A-F0-9]{4}( [A-F0-9]{4})?"]
CHOICES = ["red", "green", 'say "hi"', "日本"]


@pytest.fixture(scope="module")
def folder(make_tiny):
    return str(make_tiny("qwen3"))


def json_params(schema, seed: int, **kwargs) -> SamplingParams:
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=200, structured_outputs=constraint, **kwargs
    )


def free_params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)


def mixed_batch() -> list[SamplingParams]:
    """Every schema twice, regexes, a choice, a grammar and a JSON object, between free rows."""
    params = []
    for i, schema in enumerate(SCHEMAS):
        params += [json_params(schema, 2 * i), free_params(100 + i), json_params(schema, 2 * i + 1)]
    for i, regex in enumerate(REGEXES):
        constraint = StructuredOutputsParams(regex=regex)
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                     structured_outputs=constraint))  # fmt: skip
    for constraint in (
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
    ):
        params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=200,
                                     structured_outputs=constraint))  # fmt: skip
    return params


def check_output(params: SamplingParams, completion) -> None:
    """The output satisfies its constraint, by a parser that is not xgrammar."""
    constraint = params.structured_outputs
    if constraint is None:
        assert len(completion.token_ids) == params.max_tokens
        return
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    text = completion.text
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice
    else:
        assert re.fullmatch(r"\(\d+(\+\d+)*\)", text), text


def run(folder: str, params: list[SamplingParams], **engine_args):
    llm = LLM(folder, **{"max_model_len": 512, **engine_args})
    prompts = [f"request {i}: answer in the format asked" for i in range(len(params))]
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_constrained_rows_satisfy_their_constraints_beside_free_rows(folder, async_batching):
    params = mixed_batch()
    _, outputs = run(folder, params, async_batching=async_batching, num_blocks=256)
    for p, out in zip(params, outputs, strict=True):
        check_output(p, out.outputs[0])


def test_async_equals_sync_under_constraints_with_preemption(folder):
    """Seeded sampling: the same tokens in both modes, and under preemption (20 blocks of 16
    tokens for ~40 requests), where a resumed request's matcher keeps its place."""
    params = mixed_batch()
    results = {}
    for async_batching in (False, True):
        llm, outputs = run(
            folder,
            params,
            async_batching=async_batching,
            num_blocks=20,
            max_num_seqs=16,
            max_model_len=256,
        )
        assert llm.engine.scheduler.num_preemptions > 0
        for p, out in zip(params, outputs, strict=True):
            check_output(p, out.outputs[0])
        results[async_batching] = [out.outputs[0].token_ids for out in outputs]
    assert results[True] == results[False]


def test_each_sample_of_n_has_its_own_matcher(folder):
    params = json_params(SCHEMAS[1], seed=3, n=4)
    _, outputs = run(folder, [params])
    texts = [c.text for c in outputs[0].outputs]
    assert len(texts) == 4 and len(set(texts)) > 1
    for completion in outputs[0].outputs:
        check_output(params, completion)


def test_a_grammar_that_ends_finishes_the_request_even_with_ignore_eos(folder):
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=100,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    _, outputs = run(folder, [params])
    completion = outputs[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.text in ("yes", "no")
    assert len(completion.token_ids) < 10  # the grammar's end, then its stop token


def test_json_object_allows_objects_only(folder):
    """OpenAI's json_object is an object, not any JSON value: checked on the matcher itself
    (random weights write endless keys), then on the engine's first tokens."""
    llm = LLM(folder, max_model_len=512)
    grammars = llm.engine.admission.grammars()
    compiled = grammars.compile(StructuredOutputsParams(json_object=True))
    encode = llm.engine.tokenizer.encode
    for text, accepted in (('{"a": [1, true]}', True), ("[1]", False), ('"a"', False)):
        matcher = grammars.matcher(compiled)
        ok = all(matcher.accept_token(t) for t in encode(text, add_special_tokens=False))
        assert ok == accepted, text
    constraint = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_outputs=constraint)
    assert llm.generate(["x"], [params], use_tqdm=False)[0].outputs[0].text.startswith("{")


def test_masked_steps_sample_after_the_step_before_is_read_but_launch_before(folder, monkeypatch):
    """Async: a masked step's forward is launched before the step before it is read back (the
    overlap is kept), and its sampling only after (its masks need that step's tokens)."""
    events = []
    for name in ("launch", "launch_sampling", "wait"):
        original = getattr(Runner, name)

        def recorded(self, batch, *args, _original=original, _name=name):
            events.append((_name, batch.step, batch.use_mask))
            return _original(self, batch, *args)

        monkeypatch.setattr(Runner, name, recorded)
    params = [json_params(SCHEMAS[0], seed=1), free_params(2)]
    run(folder, params, async_batching=True)
    order = {(name, step): i for i, (name, step, _) in enumerate(events)}
    masked = [step for name, step, use_mask in events if name == "launch" and use_mask]
    later = [s for s in masked if ("wait", s - 1) in order]
    assert len(later) >= 5
    for step in later:
        assert order[("launch", step)] < order[("wait", step - 1)]
        assert order[("wait", step - 1)] < order[("launch_sampling", step)]
        assert order[("launch_sampling", step)] < order[("wait", step)]
    assert all(name != "launch_sampling" or m for name, _, m in events)


def test_raw_logprobs_under_a_grammar_are_the_models_over_the_tokens_it_allows(folder):
    """vLLM applies a grammar's bitmask before its sampler: the first token's raw logprobs are
    transformers' log-softmax over the tokens that begin a choice (a token's text a prefix of
    one), not over the whole vocabulary; other tokens are -inf, ranked after them."""
    from transformers import AutoModelForCausalLM

    choices = ["yes", "no"]
    llm = LLM(folder, max_model_len=128)
    tokenizer = llm.get_tokenizer()
    allowed = [
        t for t in range(llm.engine.model_config.vocab_size)
        if (text := tokenizer.decode([t])) and any(c.startswith(text) for c in choices)
    ]  # fmt: skip
    prompt = "answer yes or no"
    params = SamplingParams(
        temperature=0, max_tokens=3, logprobs=3,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )  # fmt: skip
    [completion] = llm.generate(prompt, params, use_tqdm=False)[0].outputs
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    want = masked.log_softmax(-1)
    first = completion.logprobs[0]
    assert completion.token_ids[0] in allowed and completion.text in choices
    assert set(allowed) <= set(first) or set(first) <= set(allowed)  # the allowed come first
    for token, logprob in first.items():
        assert logprob.logprob == pytest.approx(want[token].item(), abs=1e-4)  # -inf outside


def test_a_row_whose_other_processors_ban_the_whole_grammar_is_aborted_alone(folder):
    """allowed_token_ids outside every token the grammar allows: nothing can be sampled for
    that row; it ends with "abort" and the rows beside it are untouched."""
    llm = LLM(folder, max_model_len=512)
    digit = llm.engine.tokenizer.encode("7", add_special_tokens=False)
    broken = SamplingParams(
        max_tokens=20,
        allowed_token_ids=digit,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    fine = json_params(SCHEMAS[0], seed=5)
    outputs = llm.generate(["a", "b"], [broken, fine], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "abort"
    check_output(fine, outputs[1].outputs[0])
    assert not llm.engine.has_unfinished()


DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}  # fmt: skip


def whitespace_ids(llm: LLM) -> list[int]:
    """The ids whose text is whitespace alone: a structural tag's JSON allows any whitespace
    between tokens, which random weights would write for hundreds of tokens."""
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    return [i for i, text in enumerate(texts) if text and not text.strip()]


def seeded(count: int, max_tokens: int, bias: dict, constraint) -> list[SamplingParams]:
    """`count` requests under `constraint` with `bias`, seeds 0 and up."""
    return [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=max_tokens,
            logit_bias=bias,
            structured_outputs=constraint,
        )
        for seed in range(count)
    ]


def test_a_structural_tag_wraps_its_schema_in_its_tag(folder):
    """xgrammar's structural tag, a tag around a JSON schema: the output is the begin text, a
    JSON value of the schema, the end text (checked by jsonschema), then the request stops."""
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": SCHEMAS[0]}}}  # fmt: skip
    llm = LLM(folder, max_model_len=512)
    bias = dict.fromkeys(whitespace_ids(llm), -100.0)
    for structural_tag in (tag, json.dumps(tag)):  # a dict, or JSON text as vLLM's
        constraint = StructuredOutputsParams(structural_tag=structural_tag)
        for out in llm.generate(["A record:"] * 3, seeded(3, 200, bias, constraint), False):
            completion = out.outputs[0]
            text = completion.text
            assert completion.finish_reason == "stop", text
            assert text.startswith("<f>") and text.endswith("</f>"), text
            jsonschema.validate(json.loads(text[3:-4]), SCHEMAS[0])


def test_the_older_structural_tag_starts_a_structure_at_each_trigger(folder):
    """vLLM's older form: free text, in which each trigger ("a") begins a structure ("a=",
    a JSON value of its schema, "!"). Read back by a parser of its own: every "a" in the text
    opens one, whose JSON jsonschema checks."""
    constraint = StructuredOutputsParams(structural_tag={
        "structures": [{"begin": "a=", "schema": DIGIT, "end": "!"}], "triggers": ["a"]})  # fmt: skip
    llm = LLM(folder, max_model_len=512)
    bias = dict.fromkeys(whitespace_ids(llm), -100.0)
    bias[llm.get_tokenizer().convert_tokens_to_ids("a")] = 20.0  # the trigger comes up
    structures = 0
    for out in llm.generate(["Some text:"] * 4, seeded(4, 60, bias, constraint), False):
        text, at = out.outputs[0].text, 0
        while (at := text.find("a", at)) >= 0:
            if len(text) - at < 3:  # cut by max_tokens inside a structure
                break
            assert text[at : at + 2] == "a=", text
            try:
                value, end = json.JSONDecoder().raw_decode(text, at + 2)
            except json.JSONDecodeError:  # cut by max_tokens inside the JSON
                assert out.outputs[0].finish_reason == "length", text
                break
            jsonschema.validate(value, DIGIT)
            assert text[end : end + 1] in ("!", ""), text
            structures, at = structures + 1, end + 1
    assert structures > 0  # the trigger came up: the structures were exercised


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (dict(regex="(abc"), "xgrammar rejected the regex constraint: Regex parsing error"),
        (dict(json={"type": "objekt"}), "xgrammar rejected the json constraint: Unsupported type"),
        (dict(grammar="root ::= missing"), 'Rule "missing" is not defined'),
        (
            dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
            "Format type not recognized: nope",
        ),
    ],
)
def test_a_constraint_the_backend_rejects_is_a_value_error_before_anything_is_queued(
    folder, constraint, message
):
    llm = LLM(folder, max_model_len=512)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], [params], use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    good = json_params(SCHEMAS[6], seed=0)
    check_output(good, llm.generate(["x"], [good], use_tqdm=False)[0].outputs[0])


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems (at #)"),
        ({"type": "object", "properties": {"tags": {"type": "array", "contains": {"const": 1}}}},
         "contains (at #/properties/tags)"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "a length beside a pattern"),
        ({"type": "string", "format": "uuid", "maxLength": 5}, "a length beside a format"),
        ({"$defs": {"D": {"type": "string", "format": "no-such-format"}}, "$ref": "#/$defs/D"},
         "the string format 'no-such-format' (at #/$defs/D)"),
        ({"type": ["string", "null"], "format": "zip"}, "the string format 'zip' (at #)"),
        ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf of 2 schemas (at #)"),
        ({"type": "integer", "not": {"const": 7}}, "not (at #)"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf on a number"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
        ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
         "if with then or else"),
    ],
)  # fmt: skip
def test_a_schema_xgrammar_would_not_enforce_is_a_value_error_naming_the_keyword(
    folder, schema, words
):
    """As vLLM's check: xgrammar compiles these and lets outputs break them (e.g. [2, 2, 2]
    under uniqueItems), so they are refused rather than served wrong."""
    llm = LLM(folder, max_model_len=512)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(["x"], [params], use_tqdm=False)
    assert not llm.engine.requests


def test_what_xgrammar_enforces_passes_the_check_and_data_is_no_schema(folder):
    """A property named like a keyword, enum and const data holding one, uniqueItems false, a
    known format, an integer's multipleOf, allOf of one schema, an if alone: all compile."""
    schema = {"type": "object", "properties": {
        "uniqueItems": {"type": "boolean"}, "format": {"enum": [{"format": "x"}, "y"]},
        "when": {"type": "string", "format": "date-time"},
        "ids": {"type": "array", "uniqueItems": False, "items": {"const": {"contains": 1}}},
        "n": {"type": "integer", "format": "int64"},
        "even": {"type": "integer", "multipleOf": 2}, "only": {"allOf": [{"type": "integer"}]},
        "when_alone": {"if": {"const": 1}}, "not": {"type": "integer"}}}  # fmt: skip
    grammars = LLM(folder, max_model_len=512).engine.admission.grammars()
    assert grammars.compile(StructuredOutputsParams(json=schema)) is not None


def test_a_lark_grammar_is_read_as_lark_as_vllm(folder):
    assert is_lark('start: "yes" | "no"') and not is_lark('root ::= "yes" # a: b')
    llm = LLM(folder, max_model_len=512)
    lark = StructuredOutputsParams(grammar='start: answer\nanswer: "yes" | "no"  // a comment')
    outs = llm.generate(["x"] * 3, seeded(3, 8, {}, lark), use_tqdm=False)
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"}
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_a_structural_tags_json_takes_no_raw_control_bytes(folder):
    llm = LLM(folder, max_model_len=512)
    grammars = llm.engine.admission.grammars()
    tag = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": {"type": "string"}}}})  # fmt: skip
    assert np.array_equal(grammars.token_filter(tag), grammars.json_filters[b"\t\n\r"])


def test_a_grammar_ending_on_another_eos_names_it_as_stop_reason(folder):
    """As without a grammar: generation_config's EOS ids other than the tokenizer's are the
    stop_reason; the tokenizer's is None."""
    llm = LLM(folder, max_model_len=512)
    primary = llm.get_tokenizer().eos_token_id
    other = next(t for t in llm.engine.eos_token_ids if t != primary)
    choice = StructuredOutputsParams(choice=["yes"])
    for eos, reason in ((other, other), (primary, None)):
        params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice,
                                logit_bias={eos: 100.0, other + primary - eos: -100.0})  # fmt: skip
        completion = llm.generate(["x"], [params], use_tqdm=False)[0].outputs[0]
        assert (completion.text, completion.finish_reason) == ("yes", "stop")
        assert completion.token_ids[-1] == eos and completion.stop_reason == reason


@pytest.mark.parametrize(
    "fields",
    [
        dict(json={"type": "object"}, regex="a+"),
        dict(),
        dict(json=[1, 2]),
        dict(json="{not json"),
        dict(choice=[]),
        dict(choice=["a", 3]),
        dict(regex=""),
        dict(structural_tag="{not json"),
        dict(structural_tag=[1]),
        dict(structural_tag={"type": "structural_tag"}),  # no format
        dict(structural_tag={"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<"]}),
        dict(structural_tag={"structures": [], "triggers": ["<"]}),
        dict(structural_tag={"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}),
        dict(json={}, disable_any_whitespace="no"),  # a truthy string turned it on
        dict(json={}, disable_additional_properties="no"),
    ],
)
def test_malformed_constraints_are_value_errors(fields):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


def test_vllms_disable_additional_properties_and_an_empty_choice_are_taken(folder):
    """disable_additional_properties (vLLM's field) holds whatever its value: xgrammar's strict
    mode names no property the schema does not; "" is a choice (vLLM compiles it as one)."""
    llm = LLM(folder, max_model_len=256)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammars = llm.engine.admission.grammars()
    for flag in (True, False):
        constraint = StructuredOutputsParams.from_dict(
            {"json": schema, "disable_additional_properties": flag}
        )
        matcher = grammars.matcher(grammars.compile(constraint))
        assert matcher.accept_string('{"a": 1') and not matcher.accept_string(', "b"')
        outs = llm.generate(["x"] * 4, seeded(4, 30, {}, constraint), use_tqdm=False)
        for out in outs:
            if out.outputs[0].finish_reason == "stop":
                assert set(json.loads(out.outputs[0].text)) <= {"a"}
    empty = StructuredOutputsParams(choice=["", "yes"])
    outs = llm.generate(["x"] * 4, seeded(4, 8, {}, empty), use_tqdm=False)
    assert {o.outputs[0].text for o in outs} <= {"", "yes"}


def test_a_finished_grammar_keeps_its_stop_tokens_text_when_asked(folder):
    """include_stop_str_in_output (special tokens shown): the stop token that ends the grammar
    is in the text, as one that ends free text is (it was left out)."""
    llm = LLM(folder, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, include_stop_str_in_output=True,
                            skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(choice=["yes"]))  # fmt: skip
    tokenizer = llm.get_tokenizer()
    for stop in ([], ["never"]):  # a stop string: the text made token by token
        [out] = llm.generate(["x"], replace(params, stop=stop), use_tqdm=False)[0].outputs
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=False)
        assert out.text.startswith("yes") and len(out.text) > 3


def test_constraints_from_a_dict_name_unknown_fields():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match=r"unknown fields \['shema'\]"):
        SamplingParams(structured_outputs={"shema": {}})
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs=["a+"])


def test_a_model_without_a_tokenizer_refuses_constraints(folder, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(folder) / name).read_bytes())
    llm = LLM(str(tmp_path), max_model_len=64)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match=r"need the model's tokenizer\.json"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], [params], use_tqdm=False)


def test_the_engines_disable_any_whitespace_holds_for_every_json_request(folder):
    """vLLM's structured_outputs_config.disable_any_whitespace: whitespace, pushed up by a bias,
    fills a JSON object's output unless the engine turns it off for every request."""
    params = seeded(2, 24, {}, StructuredOutputsParams(json=DIGIT))
    loose = LLM(folder, max_model_len=256)
    bias = dict.fromkeys(whitespace_ids(loose), 100.0)
    params = [replace(p, logit_bias=bias) for p in params]
    texts = [
        o.outputs[0].text for o in loose.generate(params_prompts(params), params, use_tqdm=False)
    ]
    assert all(set(t) & set("\n\t\r") for t in texts)  # the bias wins wherever JSON allows it
    del loose
    config = {"backend": "xgrammar", "disable_any_whitespace": True, "disable_fallback": True}
    strict = LLM(folder, max_model_len=256, structured_outputs_config=config)
    outs = strict.generate(params_prompts(params), params, use_tqdm=False)
    for out in outs:
        text = out.outputs[0].text
        assert not set(text) & set("\n\t\r") and "  " not in text, text
        assert json.loads(text)["n"] in range(10)


def params_prompts(params: list[SamplingParams]) -> list[str]:
    return ["Give a digit as JSON:"] * len(params)


@pytest.mark.parametrize(
    ("config", "words"),
    [({"backend": "guidance"}, "'auto' or 'xgrammar'"), ({"enable_in_reasoning": True}, "thinking ends"),
     ({"disable_fallback": "yes"}, "disable_fallback must be True or False"),
     ({"whitespace": True}, "unknown keys ['whitespace']"), ("{not json", "no JSON"),
     ({"reasoning_parser": "qwen3"}, "contradicts reasoning_parser='deepseek_r1'")],
)  # fmt: skip
def test_structured_outputs_configs_tandem_cannot_honour_are_value_errors(folder, config, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        LLM(
            folder,
            max_model_len=64,
            structured_outputs_config=config,
            reasoning_parser="deepseek_r1",
        )


def test_the_structured_outputs_configs_reasoning_parser_is_the_engines():
    from tandem.config import EngineConfig

    config = EngineConfig("llama-3-8b", structured_outputs_config='{"reasoning_parser": "qwen3"}')
    config.check_structured_outputs_config()
    assert config.reasoning_parser == "qwen3"
    assert config.structured_outputs_config.backend == "auto"


def test_choice_grammar_escapes_quotes_and_keeps_unicode():
    assert choice_grammar(['say "hi"', "日本"]) == 'root ::= "say \\"hi\\"" | "日本"'


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_json_strings_take_no_raw_control_bytes(folder, any_whitespace):
    """xgrammar 0.2.9 lets raw control bytes into a string with maxLength; JSON parsers reject
    them, tab included. The masks of JSON constraints are ANDed with the tokens free of them
    (a schema with a length gets no tab between tokens either): checked inside such a string,
    against xgrammar's own mask (which does allow some)."""
    llm = LLM(folder, max_model_len=512)
    grammars, tokenizer = llm.engine.admission.grammars(), llm.engine.tokenizer
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}},
              "required": ["s"]}  # fmt: skip
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=not any_whitespace)
    compiled = grammars.compile(constraint)
    pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in range(len(tokenizer))]
    forbidden = {chr(c) for c in range(0x20)} - ({"\n", "\r"} if any_whitespace else set())

    def allowed_controls(token_filter) -> set[int]:
        matcher = grammars.matcher(compiled)
        for t in tokenizer.encode('{"s": "', add_special_tokens=False):
            assert matcher.accept_token(t)
        request = SimpleNamespace(
            matcher=matcher, token_filter=token_filter, finished=False, reasoning_end_id=None
        )
        mask = torch.zeros(1, grammars.words, dtype=torch.int32)
        grammars.fill_masks(mask, [request], [0], 1)
        bits = ((mask[0][:, None] >> torch.arange(32)) & 1).view(-1)
        return {t for t, p in enumerate(pieces) if bits[t] and set(p) & forbidden}

    assert allowed_controls(None)  # xgrammar alone
    assert not allowed_controls(grammars.token_filter(constraint))
    assert grammars.token_filter(StructuredOutputsParams(regex="a+")) is None
    if any_whitespace:  # without a length a tab stays whitespace between tokens
        free = StructuredOutputsParams(json={"type": "object", "properties": {"s": {}}})
        assert np.array_equal(grammars.token_filter(free), grammars.json_filters[b"\t\n\r"])


def test_a_tab_pushed_by_logit_bias_never_breaks_a_string_with_a_length(folder):
    """The output parses as JSON and keeps to the schema (a raw tab got into the string)."""
    llm = LLM(folder, max_model_len=256)
    [tab] = llm.engine.tokenizer.encode("\t", add_special_tokens=False)
    for schema in ({"type": "string", "maxLength": 5}, {"type": "string", "minLength": 2,
                                                         "maxLength": 6}):  # fmt: skip
        constraint = StructuredOutputsParams(json=schema)
        params = SamplingParams(temperature=0, max_tokens=30, logit_bias={tab: 30.0},
                                structured_outputs=constraint)  # fmt: skip
        out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_served_constraints_compile_off_the_loop_and_a_slow_regex_is_refused(folder, monkeypatch):
    """AsyncLLM builds the grammar backend and compiles a constraint on its grammar threads (a
    slow grammar never holds the threads that tokenize other prompts, nor the event loop), a
    regex on a thread of its own, as vLLM's; one still compiling after vLLM's limit is a
    ValueError and the engine serves on. Compiled grammars are cached up to vLLM's 512 MiB."""
    import asyncio
    import threading

    from tandem import async_llm, structured
    from tandem.async_llm import AsyncLLM

    llm = AsyncLLM.from_model(folder, max_model_len=256)
    admission = llm.engine.admission
    threads = []
    grammars = admission.grammars

    def recorded():
        threads.append(threading.current_thread().name)
        return grammars()

    monkeypatch.setattr(admission, "grammars", recorded)

    async def answer(params: SamplingParams, request_id: str) -> str:
        stream = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id)
        return [out async for out in stream][-1].outputs[0].text

    digits = SamplingParams(max_tokens=8, seed=1, structured_outputs={"regex": r"\d{3}"})
    choice = SamplingParams(max_tokens=8, seed=1, structured_outputs={"choice": ["yes", "no"]})
    try:
        assert asyncio.run(answer(choice, "a")) in ("yes", "no")
        # the backend built on a grammar thread; the engine's own call then finds it built
        assert threads[0].startswith("tandem-grammar") and "tandem-engine" in threads
        threads.clear()
        assert re.fullmatch(r"\d{3}", asyncio.run(answer(digits, "b")))
        assert threads[0] == "tandem-regex"
        monkeypatch.setattr(async_llm, "REGEX_COMPILE_SECONDS", 0.001)
        slow = "".join(f"(c{{{i}}}|b)*" for i in range(1, 300))
        refused = SamplingParams(max_tokens=4, structured_outputs={"regex": slow})
        with pytest.raises(ValueError, match=r"took more than 0\.001 s to compile"):
            asyncio.run(answer(refused, "c"))
        monkeypatch.setattr(async_llm, "REGEX_COMPILE_SECONDS", 5.0)
        free = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert asyncio.run(answer(free, "d")) == asyncio.run(answer(free, "e"))
        assert not llm.engine.has_unfinished()
        assert grammars().compiler.cache_limit_bytes == structured.CACHE_BYTES == 512 * 2**20
    finally:
        llm.shutdown()
    with pytest.raises(async_llm.EngineDeadError):  # not the grammar threads' RuntimeError
        asyncio.run(answer(choice, "f"))
