"""Custom logits processors, as vLLM's: classes given as `LLM(logits_processors=[...])` (or
"module:Class" names, `--logits-processors`), made once per engine, that change a step's logits
before its sampling. A processor keeps its own state about the step's rows, which
`update_state` keeps current with a `BatchUpdate` (rows removed, added, moved) before each step,
and `apply` changes the step's logits [rows, vocab] in row order. Requests opt in through their
SamplingParams (usually `extra_args`); `validate_params` refuses a request before it is queued.

What tandem keeps async-native: a processor's `update_state` and `apply` run when the step's
sampling is enqueued, on the compute stream (device work they enqueue is ordered with the
steps), with nothing read back; the forward pass still replays its CUDA graph, and only such
steps' sampling runs eagerly (user code is not captured). With async batching a step is built
while the one before it runs, so its rows' latest tokens are still on the device. A processor
that reads the values of `output_tok_ids` (`needs_output_token_ids()`, True by default, as vLLM
assumes) gets every list current: the step's sampling waits until the host has read back the
step before, as a step with structured-output masks does, while its forward pass runs (vLLM
reads the tokens back with a device sync instead). One that declares False has its sampling
launched with the forward pass, and its lists lack the token still in flight. A processor that
reads a tensor back itself (`.item()`, `.tolist()`) stalls the step loop there: on a GPU each
processor's first `apply` runs under torch's sync debug mode, and one that waited for the device
is named in a logged warning. With tensor parallelism every rank makes the processors (so their
classes must be importable there: defined in a module, or named "module:Class") and runs them on
its own logits; rank 0's tokens rule.

The order within a step is vLLM's: the processors whose `is_argmax_invariant()` is False change
the logits before penalties, bans and structured-output masks; those for which it is True, after
the rows are divided by their temperature (the sampler then draws at temperature 1; greedy rows
skip them, as their argmax cannot change).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.request import Request
    from tandem.sampling import SamplingParams

logger = logging.getLogger(__name__)
# what torch's sync debug mode "warn" says of each call that waits for the device
WAITED = "called a synchronizing CUDA operation"


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the row at a moves to b; a is left empty
    SWAP = auto()  # the rows at a and b trade places


# (index, params, prompt token ids, output token ids: the request's own list, which grows)
AddedRequest = tuple[int, "SamplingParams", list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]  # (a, b, directionality)
RemovedRequest = int  # the index left empty


@dataclass(frozen=True)
class BatchUpdate:
    """How the step's rows changed since the last step: apply `removed`, then `added`, then
    `moved`, in that order. An added or moved row replaces what its index held."""

    batch_size: int  # rows of this step
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM's interface: subclass it and give the class to `LLM(logits_processors=[...])`."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request whose parameters this processor cannot take."""
        return None  # every request, unless a subclass says otherwise

    @classmethod
    def needs_output_token_ids(cls) -> bool:
        """Whether it reads the values of `output_tok_ids` (True: the lists are kept current,
        see the module's docstring; False: they may lack the tokens still in flight)."""
        return True

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        """Made once per engine: `vllm_config` is the engine's EngineConfig."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits [rows, vocab] (float32) -> the changed logits (in place or new);
        launched while the device still runs earlier steps, so nothing in it may wait for the
        device (`.item()`, a blocking copy, `logits[:, ids] = value`: see the README)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when it never changes a row's most likely token (then greedy rows skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Before each step: how its rows changed (None: not at all)."""


RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """vLLM's wrapper of per-request processors: `new_req_logits_processor(params)` gives a
    request's function (or None), called each step as fn(output_ids, logits_row) -> row, or
    fn(prompt_ids, output_ids, logits_row) -> row, on that request's row alone."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        # index -> (function, takes prompt ids, prompt ids, output ids)
        self.rows: dict[int, tuple[RequestLogitsProcessor, bool, list[int], list[int]]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's function, or None where this request does not use it."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def entry(params, prompt_ids, output_ids):
            fn = self.new_req_logits_processor(params)
            if fn is None:
                return None
            return fn, _positional_arity(fn) == 3, prompt_ids or [], output_ids

        process_dict_updates(self.rows, batch_update, entry)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (fn, takes_prompt, prompt_ids, output_ids) in self.rows.items():
            row = logits[index]
            new = fn(prompt_ids, output_ids, row) if takes_prompt else fn(output_ids, row)
            if new is not row:
                logits[index] = new
        return logits


def process_dict_updates(
    entries: dict[int, Any],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], Any],
) -> bool:
    """vLLM's helper: a processor's per-row entries (index -> state) kept current: removed
    rows dropped, added rows given new_state(params, prompt ids, output ids) (None: no entry),
    moves and swaps carried out. True when the entries changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is None:
            changed |= entries.pop(index, None) is not None
        else:
            entries[index], changed = state, True
    for a, b, direction in batch_update.moved:
        moving, replaced = entries.pop(a, None), entries.pop(b, None)
        if direction is MoveDirectionality.SWAP and replaced is not None:
            entries[a] = replaced
        if moving is not None:
            entries[b] = moving
        changed |= moving is not None or replaced is not None
    return changed


def _positional_arity(fn: Callable) -> int:
    parameters = inspect.signature(fn).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def resolve(spec: type | str) -> type[LogitsProcessor]:
    """A processor class, or its "package.module:Class" / "package.module.Class" name."""
    cls = spec
    if isinstance(spec, str):
        module_name, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
        if not module_name or not name:
            raise ValueError(
                f"logits_processors names a class as 'package.module:Class', got {spec!r}"
            )
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"logits processor {spec!r} cannot be imported: {error}") from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise TypeError(
            f"logits_processors takes subclasses of tandem.logits_processors.LogitsProcessor "
            f"(or their names), got {spec!r}"
        )
    return cls


class LogitsProcessors:
    """An engine's custom processors: requests checked by each, each step's row changes handed
    to each (`update`), and the step's logits changed by each (`before_penalties`,
    `after_temperature`; runner.py's sampling calls them)."""

    def __init__(self, specs: Sequence[type | str], config: Any, device: torch.device):
        self.classes = [resolve(spec) for spec in specs]
        pin = device.type == "cuda"
        self.processors = [cls(config, device, pin) for cls in self.classes]
        # on a GPU, the ids of the processors whose first apply is still to be watched for
        # device waits (ids: a processor need not be hashable)
        self.unwatched = {id(p) for p in self.processors} if device.type == "cuda" else set()
        # some read output ids: a step's sampling waits for the host's read of the one before
        self.read_outputs = any(cls.needs_output_token_ids() for cls in self.classes)
        # the last step's requests in row order, by identity: a request id used again after its
        # request finished is a new request to the processors
        self.rows: list[Request] = []

    def validate(self, params: SamplingParams) -> None:
        for cls in self.classes:
            cls.validate_params(params)

    def update(self, requests: list[Request]) -> None:
        """Hand each processor how this step's rows differ from the last step's."""
        update = batch_update(self.rows, requests)
        if update is not None:  # else the rows are the last step's
            self.rows = list(requests)
        for processor in self.processors:
            processor.update_state(update)

    def before_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits as float32 (vLLM's processors take them so), through the
        processors that may change a row's argmax."""
        logits = logits.float()
        for processor in self.processors:
            if not processor.is_argmax_invariant():
                logits = self.apply(processor, logits)
        return logits

    def after_temperature(
        self, logits: torch.Tensor, temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [rows, vocab], temperature [rows]) -> the same through the argmax-invariant
        processors: sampled rows divided by their temperature first, which becomes 1 (greedy
        rows, temperature 0, keep their logits and theirs)."""
        invariant = [p for p in self.processors if p.is_argmax_invariant()]
        if not invariant:
            return logits, temperature
        sampled = temperature > 0
        scaled = logits / torch.where(sampled, temperature, 1.0)[:, None].to(logits.dtype)
        for processor in invariant:
            scaled = self.apply(processor, scaled)
        logits = torch.where(sampled[:, None], scaled, logits)
        return logits, torch.where(sampled, 1.0, temperature)

    def apply(self, processor: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
        """The processor's result; its first on a GPU watched for waits for the device."""
        if id(processor) not in self.unwatched:
            return checked(processor, logits, processor.apply(logits))
        self.unwatched.discard(id(processor))
        with device_waits() as waits:
            out = processor.apply(logits)
        if waits:
            logger.warning(
                "%s.apply waits for the device (%d synchronizing calls in one step): every "
                "step's launch stalls there until the GPU is idle. Keep it on the device (no "
                ".item(), .tolist() or blocking copies; index_fill_ rather than assigning "
                "through an index tensor)",
                type(processor).__name__,
                len(waits),
            )
        return checked(processor, logits, out)


@contextmanager
def device_waits() -> Iterator[list[str]]:
    """Collects the synchronizing CUDA calls made inside it (torch's sync debug mode "warn"
    meanwhile, the mode before it set back after); other warnings pass on."""
    found: list[str] = []
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(before)
    for warning in caught:  # the others shown as they would have been
        if WAITED in str(warning.message):
            found.append(str(warning.message))
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )


def checked(processor: LogitsProcessor, logits: torch.Tensor, out: object) -> torch.Tensor:
    """A processor's result, if it is logits of the shape it was given (a host-side check)."""
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(
            f"{type(processor).__name__}.apply must return the logits it was given or a "
            f"tensor of their shape {tuple(logits.shape)}, got {shape}"
        )
    return out


def batch_update(last: list[Request], requests: list[Request]) -> BatchUpdate | None:
    """The operations that turn the last step's rows (requests) into this step's: rows of
    requests gone are removed; new requests are added at a free index (their own row where it
    is free, else one a removal left or one past both steps' rows); then swaps put every
    request at its row. None when nothing changed. Requests are told apart by identity (ids
    of the objects, all alive in `last` or `requests`), not by request id."""
    ids = [id(request) for request in requests]
    if ids == [id(request) for request in last]:
        return None
    now = set(ids)
    slots: list[int | None] = [id(request) for request in last]
    removed = [i for i, key in enumerate(slots) if key not in now]
    for i in removed:
        slots[i] = None
    slots += [None] * max(0, len(ids) - len(slots))
    where = {key: i for i, key in enumerate(slots) if key is not None}
    added = []
    for row, request in enumerate(requests):
        if id(request) in where:
            continue
        free = row if slots[row] is None else _free_slot(slots, row)
        slots[free] = id(request)
        where[id(request)] = free
        params = request.params
        added.append((free, params, request.prompt_token_ids, request.output_token_ids))
    moved = []
    for row, key in enumerate(ids):
        at = where[key]
        if at == row:
            continue
        other = slots[row]
        slots[row], slots[at] = key, other
        where[key] = row
        if other is not None:
            where[other] = at
            moved.append((at, row, MoveDirectionality.SWAP))
        else:
            moved.append((at, row, MoveDirectionality.UNIDIRECTIONAL))
    return BatchUpdate(batch_size=len(ids), removed=removed, added=added, moved=moved)


def _free_slot(slots: list[int | None], avoid: int) -> int:
    """An empty index of `slots` other than `avoid`, one appended if none is."""
    for i, key in enumerate(slots):
        if key is None and i != avoid:
            return i
    slots.append(None)
    return len(slots) - 1
