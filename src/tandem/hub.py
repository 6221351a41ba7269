"""Models named by a Hugging Face Hub repository, as vLLM takes them: `LLM("Qwen/Qwen3-0.6B")`.

A name that is neither a local folder nor a preset is a repository id: its files are fetched
into the Hub's cache (or `download_dir`) by `huggingface_hub`, or found there when the Hub
cannot be reached (`HF_HUB_OFFLINE=1`), and the engine reads the snapshot's folder as it reads
any model folder. Only what the engine reads is fetched: configs, tokenizer files and the chat
template, and the safetensors weights unless the weights are random (`load_format="dummy"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tandem.config import EngineConfig

CONFIG_FILES = ["*.json", "*.jinja"]  # configs, tokenizer.json and its config, chat template
WEIGHT_FILES = ["*.safetensors"]


class Source(NamedTuple):
    """Where a repository is read: vLLM's `revision` (a branch, tag or commit; None: the default
    branch), `download_dir` (None: the Hub's cache) and `hf_token` (None: the environment's or
    saved login's token, as huggingface_hub finds it)."""

    revision: str | None = None
    download_dir: str | None = None
    token: bool | str | None = None


DEFAULT = Source()


def is_path(name: str) -> bool:
    """Whether a name that is no folder was meant as one (a path), not as a repository id."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def snapshot(repo_id: str, source: Source, weights: bool = True) -> Path:
    """The local folder of `repo_id` as `source` names it, fetched where it is not there yet. A
    repository that cannot be found or fetched is a FileNotFoundError saying why."""
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    patterns = CONFIG_FILES + (WEIGHT_FILES if weights else [])
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=source.revision,
            cache_dir=source.download_dir,
            token=source.token,
            allow_patterns=patterns,
            # offline: the cache alone, for a commit too (the Hub would be asked for its files)
            local_files_only=huggingface_hub.is_offline_mode(),
        )
    except HFValidationError as error:
        raise FileNotFoundError(
            f"{repo_id!r} is not a Hugging Face Hub repository id: {error}"
        ) from error
    except (OSError, ValueError) as error:  # not found, no such revision, offline and not cached
        at = f" at revision {source.revision!r}" if source.revision else ""
        raise FileNotFoundError(
            f"could not fetch the Hugging Face Hub repository {repo_id!r}{at}: {error}"
        ) from error
    return Path(folder)


def tokenizer_folder(config: EngineConfig, model_folder: Path | None) -> Path | None:
    """The folder of the engine's tokenizer: `config.tokenizer` (a folder, or a repository at
    `tokenizer_revision`), else the model's own folder (the model's repository at
    `tokenizer_revision` where one is given, as vLLM reads it); None when the model is a preset."""
    name = config.tokenizer or (config.model if config.tokenizer_revision else None)
    if name is None:
        return model_folder
    folder = Path(name).expanduser()
    if not folder.is_dir():
        if is_path(name):
            raise FileNotFoundError(f"tokenizer {name!r}: no such folder")
        source = Source(config.tokenizer_revision, config.download_dir, config.hf_token)
        folder = snapshot(name, source, weights=False)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer {name!r} has no tokenizer.json")
    return folder
