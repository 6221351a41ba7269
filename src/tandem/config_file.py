"""vLLM's `--config FILE`: a YAML mapping of flags, read into the command line before the flags
given on it, so that those win (argparse keeps the last value of a flag).

    model: meta-llama/Llama-3.1-8B-Instruct
    port: 8001
    max_num_seqs: 128          # or max-num-seqs
    enable_prefix_caching: false
    api_key: [key-a, key-b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def expand(argv: list[str], command: argparse.ArgumentParser) -> list[str]:
    """argv of a command (argv[0] its name) with `--config FILE` replaced by the file's flags,
    put right after the name, or after a MODEL given first (as vLLM's: that model wins over
    the file's, and a list the file ends with cannot take it as one more value)."""
    rest, path = [], None
    i = 1
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].partition("=")[2], i + 1
        else:
            rest.append(argv[i])
            i += 1
    if path is None:
        return argv
    settings = read(path)
    if rest and not rest[0].startswith("-"):
        settings.pop("model", None)
        return [argv[0], rest[0], *flags(settings, command), *rest[1:]]
    return [argv[0], *flags(settings, command), *rest]


def read(path: str) -> dict[str, Any]:
    try:
        settings = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"--config {path}: no YAML: {problem}{where}") from None
    if not isinstance(settings, dict) or not all(isinstance(k, str) for k in settings):
        raise ValueError(f"--config {path}: must hold a mapping of flag names to values")
    if "config" in settings:
        raise ValueError(f"--config {path}: a config file cannot name another (its 'config')")
    return settings


def flags(settings: dict[str, Any], command: argparse.ArgumentParser) -> list[str]:
    """The command-line form of each setting: `true` names the flag, `false` its --no- form (or
    nothing, where the flag is only an on switch), a list its values, a mapping its JSON."""
    known = command._option_string_actions
    argv: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            off = "--no-" + flag[2:]
            argv += [off] if off in known else []
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, dict):
            argv.append(f"{flag}={json.dumps(value)}")
        else:  # one token: a value starting with "-" stays a value, a misspelt flag keeps its own
            argv.append(f"{flag}={value}")
    return argv
