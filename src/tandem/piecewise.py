"""Steps that no whole CUDA graph runs (prefill, logprobs) as graphs cut at their attentions.

A decode-only step is one CUDA graph (runner.py). A step with prefill cannot be one: its
attention launches follow the host's query lengths (how many one-token rows lead, the longest
prompt). Everything else in it has fixed shapes given its token count, so the step is cut at its
attentions into num_layers + 1 pieces:

    piece 0:  carry-over, embedding, layer 0 up to its attention (q; K/V to the cache)
    piece i:  layer i-1 after its attention (o projection, norm, MLP), layer i up to its attention
    piece L:  layer L-1 after its attention, the final norm

Each piece is captured for a few token counts (`token_buckets`); a step pads its tokens to the
next count (padding rows have slot -1: they store no K/V, and nothing reads their outputs). The
attentions run eagerly between the replays, reading and writing fixed buffers: q, the
attention's output, and the residual stream, which the pieces advance in place. Eagerly, such a
step launches some 25 kernels per layer from Python; on a slow host the GPU waited on those
launches (BENCHMARKS.md, tenth and eleventh runs).

Piece 0 reads the step's inputs from its IO slot, so it has one graph per slot; it copies the
positions and cache slots into this module's buffers, where the later pieces read them.
"""

from __future__ import annotations

import torch

from tandem import envs
from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.io_slot import PackedBuffers, carry_over
from tandem.model.decoder import Decoder

SMALLEST_BUCKET = 16
# TANDEM_PIECEWISE=0: steps with prefill run eagerly, to compare against
ENABLED = envs.piecewise()


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts the pieces are captured for, ascending: powers of two up to 512, then eight
    per doubling, then `max_tokens`. Past 512 tokens a step pads at most an eighth more rows:
    there its matmuls are no longer cheap, and on a large model such a step is bound by the GPU,
    where padding costs time the eager step would not spend. E.g. 3000 -> [16, 32, ..., 512,
    576, 640, ..., 1024, 1152, ..., 2048, 2304, 2560, 2816, 3000]."""
    buckets, size = [], SMALLEST_BUCKET
    while size < min(max_tokens, 512):
        buckets.append(size)
        size *= 2
    while size < max_tokens:
        buckets.append(size)
        size += (1 << (size.bit_length() - 1)) // 8  # an eighth of the power of two below
    return [*buckets, max_tokens]


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest bucket that holds `num_tokens` (None: more tokens than the largest)."""
    return next((size for size in buckets if size >= num_tokens), None)


class PiecewiseGraphs:
    """The pieces of a step with prefill, their buffers and, on CUDA once captured, their graphs.
    Uncaptured (CPU), the same pieces run eagerly."""

    def __init__(
        self,
        model: Decoder,
        kv_caches: list[torch.Tensor],
        attend: AttentionBackend,
        max_tokens: int,
        device: torch.device,
    ):
        self.model, self.kv_caches, self.attend = model, kv_caches, attend
        cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
        # what crosses a cut; a step uses the first `bucket` rows
        self.positions = torch.zeros(max_tokens, dtype=torch.int32, device=device)  # [tokens]
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        # [tokens, hidden] in the model dtype, advanced in place by each norm
        self.residual = torch.zeros(max_tokens, cfg.hidden_size, dtype=dtype, device=device)
        # [tokens, heads, head_dim]: rotary's q, the attention's output
        self.q = torch.zeros(max_tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros_like(self.q)
        # (slot for piece 0 else -1, bucket, piece) -> graph; bucket -> piece L's output
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    def piece(
        self, i: int, rows: int, inputs: PackedBuffers, prev_sampled: torch.Tensor
    ) -> torch.Tensor | None:
        """Piece i over the first `rows` token rows; the last piece returns the final hidden
        states [rows, hidden]. `inputs` are the step's slot inputs and `prev_sampled` the
        previous step's sampled ids (piece 0's carry-over)."""
        model, layers = self.model, self.model.layers
        positions, slot_mapping = self.positions[:rows], self.slot_mapping[:rows]
        residual = self.residual[:rows]
        if i == 0:
            ids = carry_over(inputs["input_ids"][:rows], inputs["carry_index"][:rows], prev_sampled)
            positions.copy_(inputs["positions"][:rows])
            slot_mapping.copy_(inputs["slot_mapping"][:rows])
            if model.lora is not None:  # each token's adapter, for every piece's projections
                model.lora.select(inputs["lora_slots"][:rows])
            residual.copy_(model.embed(ids))
            x, add_to = residual, None  # layer 0 normalizes the embeddings, which start the stream
        else:
            x, add_to = layers[i - 1].after_attention(self.attended[:rows], residual)
        if i == len(layers):
            return model.norm.add_forward(x, add_to)[0]
        layers[i].before_attention(
            x, add_to, positions, self.kv_caches[i], slot_mapping, q_out=self.q[:rows]
        )
        return None

    def forward(
        self,
        slot: int,
        inputs: PackedBuffers,
        prev_sampled: torch.Tensor,
        bucket: int,
        num_tokens: int,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's final hidden states [bucket, hidden] (rows from num_tokens on are
        padding): each piece replayed (or run eagerly, uncaptured), the attentions between."""
        q, attended = self.q[:num_tokens], self.attended[:num_tokens]
        layers = self.model.layers
        hidden = None
        for i in range(self.num_pieces):
            if i:
                options = layers[i - 1].self_attn.attend_options()
                self.attend(q, self.kv_caches[i - 1], meta, out=attended, **options)
            key = (slot if i == 0 else -1, bucket, i)
            if key in self.graphs:
                self.graphs[key].replay()
            else:
                hidden = self.piece(i, bucket, inputs, prev_sampled)
        return self.hidden[bucket] if hidden is None else hidden

    @torch.inference_mode()
    def capture(
        self,
        buckets: list[int],
        slot_inputs: list[tuple[PackedBuffers, torch.Tensor]],
        pool,
        stream: torch.cuda.Stream,
    ) -> None:
        """Captures every piece for every bucket, largest first (smaller buckets then fit in
        the memory the largest took from `pool`). `slot_inputs`: (inputs, previous step's
        sampled ids) of each slot, for piece 0. Capture runs before any request: the warm-up
        runs write K/V at whatever slots the inputs hold, which nothing has yet."""
        for bucket in sorted(buckets, reverse=True):
            with torch.cuda.stream(stream):  # warm-up: kernels compiled and chosen, workspaces
                for i in range(self.num_pieces):
                    self.piece(i, bucket, *slot_inputs[0])
            for i in range(self.num_pieces):
                for slot, (inputs, prev_sampled) in enumerate(slot_inputs):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = self.piece(i, bucket, inputs, prev_sampled)
                    self.graphs[(slot if i == 0 else -1, bucket, i)] = graph
                    if out is not None:
                        self.hidden[bucket] = out
                    if i:
                        break  # pieces after the first read no slot: one graph serves both

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.hidden.clear()
