"""LoRA adapters: PEFT folders read into host memory, and the device slots they run in.

A request names its adapter with a `LoRARequest` (vLLM's, `request.py`). The engine reads the
folder when the request is made (`AdapterCache`): errors are the caller's, raised before anything
is queued. On the device `max_loras` slots hold adapters (model/lora.py); the scheduler gives a
request its adapter's slot when it admits it (`AdapterSlots`), loading the adapter into a slot
that no running request holds where it is in none. The load runs on the compute stream before
the step's forward: every step launched before it, which may still read the slot's old adapter,
has read it first.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem import hub
from tandem.config import ModelConfig
from tandem.lora.request import LoRARequest, id_clash
from tandem.model_files import read_json, safetensors_tensors
from tandem.parallel import TensorParallel, shard_tensor

# a PEFT tensor of a decoder layer's projection: layer, module, A or B
PEFT_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# a checkpoint matrix -> (our projection, its lane); fused checkpoint matrices split into lanes
LANES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PROJECTIONS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}  # -> lanes
ROW_PARALLEL = ("o_proj", "down_proj")  # their input features are split across ranks


# (layer, projection) -> (A [lanes, rank, in] and B [out, lanes, rank], B scaled), this rank's
HostWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Adapter:
    request: LoRARequest
    weights: HostWeights


@dataclass(frozen=True)
class ProjectionShape:
    """A projection of this rank: its input width and the output rows of each lane."""

    in_features: int
    lane_rows: tuple[int, ...]


def read_adapter(
    request: LoRARequest,
    shapes: dict[int, dict[str, ProjectionShape]],
    max_rank: int,
    full_cfg: ModelConfig,
    tp: TensorParallel,
    dtype: torch.dtype,
    pin: bool,
    source: hub.Source = hub.DEFAULT,
) -> Adapter:
    """The adapter of `request.lora_path` (a PEFT folder, or a Hugging Face Hub repository id
    read as `source` says) as this rank's host blocks for every projection in `shapes` (layer
    -> projection -> shape; a MoE layer has no MLP projections). ValueError for what the engine
    cannot run, saying what it is."""
    from tandem.model import hf_names  # it imports the decoder, which imports us

    folder = adapter_folder(request, source)
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {request.lora_name!r}: {folder} has no adapter_config.json")
    rank, scale = check_adapter_config(request, read_json(config_path), max_rank)
    weights: HostWeights = {}
    for layer, modules in shapes.items():
        for projection, shape in modules.items():
            lanes = len(shape.lane_rows)
            a = torch.zeros(lanes, max_rank, shape.in_features, dtype=dtype)
            b = torch.zeros(sum(shape.lane_rows), lanes, max_rank, dtype=dtype)
            weights[(layer, projection)] = (a, b)
    for (layer, module), (lora_a, lora_b) in read_pairs(request, folder).items():
        if layer not in shapes:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} has weights for layer {layer}; the model "
                f"has {len(shapes)} layers"
            )
        attention = module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
        base = f"model.layers.{layer}.{'self_attn' if attention else 'mlp'}.{module}"
        # a fused checkpoint matrix's B (Phi-3's qkv_proj, GLM-4's gate_up_proj) cut as its
        # weight is: into the matrices it stacks
        parts = (
            hf_names.split_fused(base, "weight", lora_b, full_cfg)
            if module in FUSED
            else [(f"{base}.weight", lora_b)]
        )
        try:
            for name, part_b in parts:
                # B's rows as the loader keeps the base weight's (hf_names.output_rows)
                part_b = hf_names.output_rows(name, part_b, full_cfg)
                place(weights, shapes[layer], name, (lora_a, part_b), (rank, scale), full_cfg, tp)
        except ValueError as error:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {error}") from error
    if pin:
        weights = {key: (a.pin_memory(), b.pin_memory()) for key, (a, b) in weights.items()}
    return Adapter(request, weights)


def place(
    weights: HostWeights,
    shapes: dict[str, ProjectionShape],
    name: str,
    pair: tuple[torch.Tensor, torch.Tensor],
    rank_and_scale: tuple[int, float],
    cfg: ModelConfig,
    tp: TensorParallel,
) -> None:
    """One checkpoint matrix's A [r, in] and B [out, r] (`name`: its weight's) into its
    projection's lane of the layer's host blocks: this rank's slice, B times the scale."""
    (lora_a, lora_b), (rank, scale) = pair, rank_and_scale
    layer, leaf = int(name.split(".")[2]), name.split(".")[-2]
    projection, lane = LANES[leaf]
    if projection not in shapes:
        raise ValueError(
            f"a LoRA adapter targets {leaf} of layer {layer}, which is a mixture-of-experts "
            "block: LoRA on experts is not supported"
        )
    if projection in ROW_PARALLEL:  # sliced as the weight is: A by input, B by output
        lora_a = shard_tensor(name, lora_a, cfg, tp)
    else:
        lora_b = shard_tensor(name, lora_b, cfg, tp)
    a, b = weights[(layer, projection)]
    shape = shapes[projection]
    first, rows = sum(shape.lane_rows[:lane]), shape.lane_rows[lane]
    if lora_a.shape != (rank, a.shape[2]) or lora_b.shape != (rows, rank):
        raise ValueError(
            f"a LoRA adapter's {leaf} of layer {layer} has A {tuple(lora_a.shape)} and B "
            f"{tuple(lora_b.shape)} here, which do not fit its rank {rank} and the base model's "
            f"projection ({a.shape[2]} inputs, {rows} outputs): an adapter of another model?"
        )
    a[lane, :rank] = lora_a.to(a.dtype)
    b[first : first + rows, lane, :rank] = (lora_b.float() * scale).to(b.dtype)


def adapter_folder(request: LoRARequest, source: hub.Source) -> Path:
    """The adapter's local folder: `lora_path` itself, or the Hub repository it names (fetched
    into the Hub's cache, as vLLM takes one)."""
    folder = Path(request.lora_path).expanduser()
    if folder.is_dir() or hub.is_path(request.lora_path):
        return folder
    try:
        return hub.snapshot(request.lora_path, source)
    except FileNotFoundError as error:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r}: no such folder, and {error}"
        ) from error


def check_adapter_config(request: LoRARequest, config: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a PEFT LoRA config; ValueError for what the engine does not run."""
    name = request.lora_name
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r} is a {config['peft_type']} adapter, not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"LoRA adapter {name!r}: adapter_config.json's r must be >= 1, got {rank!r}"
        )
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {name!r} has rank {rank}, over max_lora_rank={max_rank}; start the "
            f"engine with max_lora_rank >= {rank}"
        )
    unsupported = {
        "use_dora": "DoRA",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
        "layer_replication": "layer_replication",
        "use_qalora": "QALoRA (use_qalora)",
        "lora_bias": "LoRA biases (lora_bias)",
        "target_parameters": "LoRA on parameters (target_parameters)",
        "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
        "arrow_config": "Arrow routing (arrow_config)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases ({config['bias']!r}): not supported")
    alpha = config.get("lora_alpha", 8)  # PEFT's default, as PEFT runs a config without it
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def read_pairs(request: LoRARequest, folder: Path) -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (A [r, in], B [out, r]) of the folder's adapter_model.safetensors, or
    of its adapter_model.bin (PEFT's older format) where it has no safetensors file."""
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in adapter_tensors(request, folder):
        match = PEFT_KEY.search(key)
        if match is None or (match[3] not in LANES and match[3] not in FUSED):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} has {key!r}: only LoRA on the decoder "
                "layers' q/k/v/o and gate/up/down projections is supported"
            )
        found[(int(match[1]), match[3], match[4])] = tensor
    pairs = {}
    for (layer, module, kind), tensor in found.items():
        if kind == "A":
            lora_b = found.get((layer, module, "B"))
            if lora_b is None or lora_b.shape[1] != tensor.shape[0]:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: {module} of layer {layer} lacks a "
                    "lora_B matching its lora_A"
                )
            pairs[(layer, module)] = (tensor, lora_b)
    if len(pairs) * 2 != len(found):
        raise ValueError(f"LoRA adapter {request.lora_name!r}: a lora_B has no lora_A")
    return pairs


def adapter_tensors(request: LoRARequest, folder: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of adapter_model.safetensors, else of adapter_model.bin, read as vLLM
    reads it (tensors only: torch.load's weights_only)."""
    safetensors, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if safetensors.is_file():
        return safetensors_tensors(safetensors)
    if not pickled.is_file():
        raise ValueError(
            f"LoRA adapter {request.lora_name!r}: {folder} has no adapter_model.safetensors "
            "or adapter_model.bin"
        )
    try:
        state = torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load's errors are of any type: a pickle, a zip, ...
        raise ValueError(
            f"LoRA adapter {request.lora_name!r}: {pickled} is no state dict of tensors ({error})"
        ) from error
    named = isinstance(state, dict) and all(isinstance(k, str) for k in state)
    if not named or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(
            f"LoRA adapter {request.lora_name!r}: {pickled} is no state dict of tensors"
        )
    return state.items()


class AdapterCache:
    """Adapters read from disk, by id: those of unfinished requests always, and up to
    `max_cpu_loras` others, least recently used dropped first. Thread-safe: AsyncLLM reads an
    adapter off the engine thread first, so that its steps never wait on a disk."""

    def __init__(self, read: Callable[[LoRARequest], Adapter], max_cpu_loras: int):
        self.read = read
        self.max_cpu_loras = max_cpu_loras
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()
        self.users: dict[int, int] = {}  # id -> unfinished requests naming it
        self.pinned: set[int] = set()  # ids kept however long unused (vLLM's pin_lora)
        self.lock = threading.Lock()  # held for bookkeeping only, never while reading

    def get(self, request: LoRARequest) -> Adapter:
        """The adapter, read if it is not held; ValueError where one id names two adapters."""
        with self.lock:
            held = self._held(request)
        if held is not None:
            return held
        try:
            adapter = self.read(request)
        except OSError as error:  # a folder the system refuses (a name too long, no access)
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {error}") from error
        with self.lock:
            held = self._held(request)  # read by another thread meanwhile
            if held is not None:
                return held
            self.adapters[request.lora_int_id] = adapter
            self._trim()
        return adapter

    def _held(self, request: LoRARequest) -> Adapter | None:
        held = self.adapters.get(request.lora_int_id)
        if held is None:
            return None
        if held.request.identity != request.identity:
            raise id_clash(held.request, request)
        self.adapters.move_to_end(request.lora_int_id)
        return held

    def hold(self, lora_id: int) -> None:
        with self.lock:
            self.users[lora_id] = self.users.get(lora_id, 0) + 1

    def drop(self, lora_id: int) -> None:
        with self.lock:
            self.users[lora_id] -= 1
            if not self.users[lora_id]:
                del self.users[lora_id]
            self._trim()

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter no unfinished request names (vLLM's remove_lora); False where it is
        not held or in use."""
        with self.lock:
            if lora_id not in self.adapters or lora_id in self.users:
                return False
            del self.adapters[lora_id]
            self.pinned.discard(lora_id)
            return True

    def pin(self, lora_id: int) -> bool:
        """Keep a held adapter until removed (vLLM's pin_lora); False where it is not held."""
        with self.lock:
            if lora_id not in self.adapters:
                return False
            self.pinned.add(lora_id)
            return True

    def _trim(self) -> None:
        # least recently used first; pinned adapters neither go nor count against max_cpu_loras
        idle = [i for i in self.adapters if i not in self.users and i not in self.pinned]
        surplus = len(self.adapters) - len(self.pinned) - self.max_cpu_loras
        for lora_id in idle[: max(0, surplus)]:
            del self.adapters[lora_id]


class AdapterSlots:
    """Which adapter each device slot holds and how many running requests hold it. A slot that
    none holds may take another adapter (its loads go with the next step: `take_loads`)."""

    def __init__(self, num_slots: int, cache: AdapterCache):
        self.cache = cache
        # slot -> its adapter's identity (an id may have named another adapter since)
        self.adapter_of: list[tuple[int, str, str] | None] = [None] * num_slots
        self.holders = [0] * num_slots
        self.last_use = [0] * num_slots  # for choosing the least recently used free slot
        self.clock = 0
        self.loads: list[tuple[int, Adapter]] = []  # (slot, adapter), for the next step

    def can_acquire(self, lora: LoRARequest) -> bool:
        """Whether the adapter is in a slot, or a slot is held by no running request."""
        return lora.identity in self.adapter_of or 0 in self.holders

    def acquire(self, lora: LoRARequest) -> int:
        """The slot a request of adapter `lora` runs in, held for it (`can_acquire` first)."""
        self.clock += 1
        if lora.identity in self.adapter_of:
            slot = self.adapter_of.index(lora.identity)
        else:
            free = [s for s, holders in enumerate(self.holders) if holders == 0]
            # an empty slot first, else the least recently used
            slot = min(free, key=lambda s: (self.adapter_of[s] is not None, self.last_use[s]))
            self.adapter_of[slot] = lora.identity
            self.loads.append((slot, self.cache.get(lora)))
        self.holders[slot] += 1
        self.last_use[slot] = self.clock
        return slot

    def release(self, slot: int) -> None:
        self.holders[slot] -= 1

    def take_loads(self) -> list[tuple[int, Adapter]]:
        loads, self.loads = self.loads, []
        return loads
