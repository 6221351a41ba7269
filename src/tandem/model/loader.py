"""Hugging Face checkpoint folders (or named shape presets) -> a Decoder with weights in place."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from tandem import hub
from tandem.config import ModelConfig
from tandem.model import hf_names
from tandem.model.decoder import Decoder
from tandem.model_files import read_json, safetensors_tensors
from tandem.parallel import TensorParallel, intermediate_size_of, shard_config, shard_tensor
from tandem.quant import linear as fp8_linear
from tandem.quant.checkpoint import Fp8Config, checkpoint_tensors, fit_tensor, weight_scheme
from tandem.quant.int4 import Int4Config

PRESETS_DIR = Path(__file__).parent / "presets"
DUMMY_SEED_SALT = 0x5EED

# HF tensor name suffix -> (our parameter suffix, index of its slice in a stacked matrix)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def read_hf_config(
    model: str,
    source: hub.Source = hub.DEFAULT,
    weights: bool = True,
    overrides: dict | None = None,
) -> tuple[dict, Path | None]:
    """config.json of a folder, of a preset name, or else of a Hugging Face Hub repository (its
    snapshot as `source` names it, the safetensors too if `weights`: `hub.snapshot`), with
    vLLM's `hf_overrides` merged in; returns (config, folder or None for a preset)."""
    folder = Path(model).expanduser()
    preset = PRESETS_DIR / f"{model}.json"
    if not folder.is_dir():
        if preset.is_file():
            return merged(read_json(preset), overrides), None
        unknown = f"model {model!r} is neither a folder nor a preset (presets: "
        unknown += f"{', '.join(preset_names())})"
        if hub.is_path(model):
            raise FileNotFoundError(f"{unknown}: no such folder")
        try:
            folder = hub.snapshot(model, source, weights)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"{unknown}, and {error}") from error
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model} has no config.json; is it a Hugging Face model folder?")
    return merged(read_json(path), overrides), folder


def merged(config: dict, overrides: dict | None) -> dict:
    """`config` with `overrides` on top; a dict over a dict merges into it (vLLM's hf_overrides:
    {"text_config": {"rope_theta": ...}} changes that one field of the nested config)."""
    for key, value in (overrides or {}).items():
        old = config.get(key)
        config[key] = (
            merged(dict(old), value) if isinstance(old, dict) and isinstance(value, dict) else value
        )
    return config


def build_model(
    cfg: ModelConfig,
    hf_config: dict,
    folder: Path | None,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    seed: int,
    tp: TensorParallel,
    quantization: str | None = None,
    fp8_kv_cache: bool = False,
) -> Decoder:
    """`cfg` is the whole model; each rank builds and loads only its shard. FP8 weights come
    from the checkpoint's quantization_config or, with `quantization="fp8"`, from quantizing
    its weights here; int4 ones from a GPTQ, AWQ or compressed-tensors checkpoint (or random
    ones quantized here, `quant.int4`); with `fp8_kv_cache`, the checkpoint's k_scale/v_scale
    are the cache's."""
    if folder is None and load_format != "dummy":
        raise ValueError(
            "a preset has shapes but no weights; pass load_format='dummy' to use random weights"
        )
    scheme = weight_scheme(hf_config, quantization, load_format, folder)
    check_scheme(scheme, cfg, dtype, tp)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Decoder(shard_config(cfg, tp), max_position, tp, scheme)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        from tandem.model.tiny import random_weights

        # salted, so dummy weights never equal a tiny checkpoint written with the same seed
        dummy_seed = seed ^ DUMMY_SEED_SALT
        tensors = random_weights(hf_config, seed=dummy_seed, dtype=dtype, device=device)
    else:
        tensors = iter_safetensors(folder)
    kv_scales: dict[str, tuple[float, ...]] = {}
    tensors = hf_names.normalized(tensors, cfg)
    # quantized (at load) before sharding: each row's scale is the whole row's, as on one device
    tensors = checkpoint_tensors(tensors, scheme, kv_scales)
    fit = None
    if isinstance(scheme, Fp8Config):
        fit = lambda name, tensor, dest: fit_tensor(name, tensor, dest, scheme)  # noqa: E731
    load_weights(model, ((name, shard_tensor(name, t, cfg, tp)) for name, t in tensors), fit)
    if isinstance(scheme, Fp8Config):
        fp8_linear.prepare(model, dtype, device)
    if fp8_kv_cache:
        set_kv_scales(model, kv_scales)
    return model.eval()


def check_scheme(
    scheme: Fp8Config | Int4Config | None, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel
) -> None:
    if isinstance(scheme, Int4Config):
        check_int4(scheme, cfg, tp)
    elif scheme is not None:
        check_fp8(scheme, dtype, tp)


def check_int4(scheme: Int4Config, cfg: ModelConfig, tp: TensorParallel) -> None:
    if cfg.num_experts:
        raise ValueError(
            f"int4 weights ({scheme.method}) are supported for dense models; "
            f"{cfg.architecture} has mixture-of-experts layers"
        )
    # an int4 checkpoint packs several rows or columns in one int32 and lays them out its own
    # way: the rows its projections' splits and rotary reorders move are not whole tensor rows
    reordered = None
    if cfg.architecture in hf_names.FUSED_CHECKPOINTS:
        reordered = "fused q/k/v or gate/up matrices"
    elif cfg.rotary_dim or cfg.rotary_interleaved:
        reordered = "rotary dimensions reordered in each head"
    if scheme.method != "dummy" and reordered:
        raise ValueError(
            f"int4 checkpoints ({scheme.method}) of {cfg.architecture} are not supported: its "
            f"{reordered} are split or reordered by rows; load its bfloat16 checkpoint (with "
            "quantization='fp8' to halve its weights)"
        )
    if tp.size == 1:
        return
    if scheme.act_order:
        raise ValueError(
            "GPTQ checkpoints with desc_act=true run on one device: their input columns are "
            "regrouped across what tensor_parallel_size would split"
        )
    local = shard_config(cfg, tp)  # the row-parallel layers' input widths on a rank
    for name, width in (("o_proj", local.q_size), ("down_proj", local.intermediate_size)):
        if scheme.group_size and width % scheme.group_size:
            raise ValueError(
                f"int4 groups of {scheme.group_size} input features do not split across "
                f"tensor_parallel_size={tp.size}: {name} has {width} input features a rank"
            )


def check_fp8(fp8: Fp8Config, dtype: torch.dtype, tp: TensorParallel) -> None:
    if dtype == torch.float16:
        raise ValueError(
            "FP8 weights run with dtype 'bfloat16' (W8A8 on Hopper) or 'float32' (W8A16); "
            "float16 is not supported with them"
        )
    if tp.size > 1 and fp8.strategy != "channel":
        raise ValueError(
            f"FP8 checkpoints with {fp8.strategy} weight scales and tensor_parallel_size > 1 "
            "are not supported; per-channel scales and quantization='fp8' are"
        )


def set_kv_scales(model: Decoder, kv_scales: dict[str, tuple[float, ...]]) -> None:
    """The checkpoint's per-layer K and V cache scales (absent: 1.0) onto each attention;
    ValueError for a scale per head (compressed-tensors' "attn_head"), as vLLM's."""
    for i, layer in enumerate(model.layers):
        for kind in ("k_scale", "v_scale"):
            name = f"model.layers.{i}.self_attn.{kind}"
            values = kv_scales.get(name, (1.0,))
            if len(values) != 1:
                raise ValueError(
                    f"checkpoint tensor {name!r} holds a KV cache scale per head: only one per "
                    "tensor (kv_cache_scheme strategy 'tensor') is supported"
                )
            setattr(layer.self_attn, kind, values[0])


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        names = sorted(set(weight_map.values()))
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} lacks shards named in its index: {', '.join(missing)}"
            )
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} has no model.safetensors (nor a sharded index)")
    for file in files:
        yield from safetensors_tensors(file)


def load_weights(model: Decoder, tensors, fit=None) -> None:
    """Copy HF-named tensors into the model, stacking q/k/v and gate/up; every parameter must be
    set. `fit(hf_name, tensor, dest)` gives a tensor its place's layout (FP8 scales)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        found = destination(model, params, hf_name, tensor, fit)
        if found is None:
            continue
        key, dest, tensor = found
        if key in loaded and whole(params[key]) and not torch.equal(dest, tensor.to(dest.device)):
            raise ValueError(
                f"checkpoint tensor {hf_name!r} differs from the one before it for {key}: the "
                "stacked projections that share an input must share it"
            )
        loaded.add(key)
        dest.copy_(tensor)
    missing = sorted(checkpoint_name(name) for name in expected_keys(model, params) - loaded)
    if missing:
        raise ValueError(
            f"checkpoint lacks weights for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )


def stacked_sizes(model: Decoder, name: str = "") -> dict[str, list[int]]:
    """The slices' rows of each stacked parameter, as parameter `name` (one of them) has them:
    gate_up_proj's by the intermediate size of its MLP (dense, or the shared expert)."""
    cfg = model.cfg
    inter = intermediate_size_of(name, cfg)
    return {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size], "gate_up_proj": [inter, inter]}


def destination(
    model: Decoder,
    params: dict[str, torch.nn.Parameter],
    hf_name: str,
    tensor: torch.Tensor,
    fit=None,
) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """(the slice's key, the view of our parameter, the tensor in its layout) that this rank's
    `tensor` of `hf_name` is copied into; None for a tensor that is recomputed or tied.
    ValueError for an unknown name or a shape that does not fit."""
    cfg = model.cfg
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None  # older checkpoints store the rope table; it is recomputed from the config
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    expert = hf_names.expert_destination(name, params, cfg.moe_intermediate_size)
    if expert is not None:
        dest, key = expert
    elif leaf in STACKED and whole(params.get(f"{parent}.{STACKED[leaf][0]}.{kind}")):
        name = key = f"{parent}.{STACKED[leaf][0]}.{kind}"  # each slice's tensor: the same
        dest = params[name].data
    elif leaf in STACKED:
        target, index = STACKED[leaf]
        name = f"{parent}.{target}.{kind}"
        sizes = stacked_sizes(model, name)[target]
        offset = sum(sizes[:index])
        dest = params[name].data.narrow(0, offset, sizes[index]) if name in params else None
        key = f"{name}#{index}"
    else:
        dest = params[name].data if name in params else None
        key = name
    if dest is None and kind == "bias" and not tensor.any():
        return None  # GPTQ-for-LLaMa's zero bias of each projection: vLLM skips it too
    if dest is None:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {cfg.architecture}")
    if model.tp.size > 1 and name in ("embed_tokens.weight", "lm_head.weight"):
        dest = dest.narrow(0, 0, tensor.shape[0])  # the last rank's rows past the vocabulary stay 0
    if fit is not None:
        tensor = fit(hf_name, tensor, dest)
    if dest.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
        )
    return key, dest, tensor


def whole(param: torch.nn.Parameter | None) -> bool:
    """Whether a stacked projection's parameter is one for the whole stack, every slice's
    checkpoint tensor the same (an int4 layer's input order), not a slice of rows each."""
    return bool(getattr(param, "whole", False))


def expected_keys(model: Decoder, params: dict[str, torch.nn.Parameter]) -> set[str]:
    """Every slice key a full checkpoint sets (see `destination`)."""
    sizes = stacked_sizes(model)
    expected = set()
    for name, param in params.items():
        target = name.split(".")[-2]
        if (keys := hf_names.expected_expert_keys(name, param)) is not None:
            expected.update(keys)
        elif target in sizes and not whole(param):
            expected.update(f"{name}#{i}" for i in range(len(sizes[target])))
        else:
            expected.add(name)
    return expected


def checkpoint_name(name: str) -> str:
    """Our parameter name, '#i' marking slice i of a stacked one -> the checkpoint's tensor name."""
    if "experts." in name and "#" in name:
        return hf_names.expert_checkpoint_name(name)
    name, _, index = name.partition("#")
    if index:
        module, _, kind = name.rpartition(".")
        parent, _, target = module.rpartition(".")
        leaf = next(hf for hf, slot in STACKED.items() if slot == (target, int(index)))
        name = f"{parent}.{leaf}.{kind}"
    return name if name.startswith("lm_head.") else f"model.{name}"
