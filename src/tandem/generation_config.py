"""The sampling defaults a model's creators recommend, from its generation_config.json, as vLLM
takes them: `LLM.generate` without SamplingParams samples with them, and the server fills the
fields a request leaves out with them.

`generation_config` says where they come from:
- "auto" (the default): the model folder's generation_config.json, if it has one;
- "vllm": none, SamplingParams' own defaults (vLLM's name for its neutral defaults);
- a folder: the generation_config.json in it.

Only the sampling fields count (temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as max_tokens), and of them only values that differ from transformers'
GenerationConfig defaults, as vLLM reads them: a checkpoint that writes top_k 50, transformers'
default, leaves top-k off. `override_generation_config` sets fields on top (null: none), its
other keys ignored, as vLLM's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.model_files import read_json
from tandem.sampling import SamplingParams

# transformers' GenerationConfig defaults of the fields that count; a value equal to its default
# recommends nothing
TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
FILE = "generation_config.json"


def sampling_defaults(
    folder: Path | None, generation_config: str = "auto", override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams fields (max_new_tokens as max_tokens) that replace SamplingParams' own
    defaults for this model. ValueError for a `generation_config` that is neither "auto", "vllm"
    nor a folder with a generation_config.json, or an override that is no dict."""
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        config = of_folder(folder)
    elif isinstance(generation_config, str) and (Path(generation_config) / FILE).is_file():
        config = read_json(Path(generation_config) / FILE)
    else:
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder with a {FILE}, "
            f"got {generation_config!r}"
        )
    chosen = {
        name: config[name]
        for name, default in TRANSFORMERS_DEFAULTS.items()
        if config.get(name) is not None and config[name] != default
    }
    if override is not None:
        if not isinstance(override, dict):
            raise ValueError(f"override_generation_config takes a dict, got {override!r}")
        # as vLLM's: other keys (do_sample, max_tokens) count for nothing, and a null drops
        # the model's value of its field
        chosen |= {name: v for name, v in override.items() if name in TRANSFORMERS_DEFAULTS}
        chosen = {name: v for name, v in chosen.items() if v is not None}
    if "max_new_tokens" in chosen:  # transformers' name for SamplingParams' max_tokens
        chosen["max_tokens"] = chosen.pop("max_new_tokens")
    try:
        SamplingParams(**chosen)
    except (TypeError, ValueError) as error:
        raise ValueError(f"the generation config's sampling defaults {chosen}: {error}") from error
    return chosen


def of_folder(folder: Path | None) -> dict[str, Any]:
    """The model folder's generation_config.json ({} without one): its sampling defaults here,
    its eos_token_id for the engine."""
    return read_json(folder / FILE) if folder is not None and (folder / FILE).is_file() else {}
