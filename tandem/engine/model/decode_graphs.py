"""Steps of decodes alone, replayed from CUDA graphs: one launch in place of every kernel of the forward.

An eager decode step on a fast GPU is bound by launching its kernels (about 1300 for the default model),
not by the GPU. A graph records them once and replays them on fixed buffers, so a step is padded to fixed
shapes: its rows to the next of ``BATCH_SIZES``, its context to the next power of two (at least
``MIN_CONTEXT``). Padding rows write their keys and values to a scratch slot past the cache's blocks and
attend to it alone; padding positions of real rows are masked. Each shape is captured on first use, all
into one memory pool. Off CUDA the same padded step runs eagerly (how the tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.model.llama import AttentionMetadata, CausalLM

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MIN_CONTEXT = 256
WARMUP_RUNS = 2


@dataclass
class _Graph:
    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [batch]
    context_slots: torch.Tensor  # [batch * context]
    mask: torch.Tensor  # [batch, 1, 1, context]
    logits: torch.Tensor | None = None  # [batch, vocab], written by each replay
    graph: "torch.cuda.CUDAGraph | None" = None


class DecodeGraphs:
    """Runs steps of decodes through captured graphs of ``model``.

    Args:
        scratch_slot: a cache slot no block uses, where padding rows write.
        max_context: the longest context a step may attend over (the model's length limit).
    """

    def __init__(self, model: CausalLM, k_cache: torch.Tensor, v_cache: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, scratch_slot: int, max_context: int):
        self.model = model
        self.caches = (k_cache, v_cache)
        self.tables = (cos_table, sin_table)
        self.scratch_slot = scratch_slot
        self.max_context = max_context
        self.device = k_cache.device
        self.capture = self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    @property
    def shapes(self) -> set[tuple[int, int]]:
        """The (rows, context) shapes made ready so far."""
        return set(self._graphs)

    def fits(self, num_rows: int, longest_context: int) -> bool:
        return num_rows <= BATCH_SIZES[-1] and longest_context <= self.max_context

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            contexts: list[torch.Tensor]) -> torch.Tensor:
        """Logits [rows, vocab] of one step of decodes; ``contexts``: each row's context slots (CPU tensors)."""
        rows = len(input_ids)
        batch = next(size for size in BATCH_SIZES if size >= rows)
        context = max(MIN_CONTEXT, 1 << (max(len(c) for c in contexts) - 1).bit_length())
        context = min(context, max(MIN_CONTEXT, self.max_context))
        graph = self._graphs.get((batch, context)) or self._capture(batch, context)
        padding = batch - rows
        scratch = self.scratch_slot
        slots = torch.full((batch, context), scratch, dtype=torch.long)
        mask = torch.zeros(batch, context, dtype=torch.bool)
        for row, row_slots in enumerate(contexts):
            slots[row, :len(row_slots)] = row_slots
            mask[row, :len(row_slots)] = True
        mask[rows:, 0] = True
        graph.input_ids.copy_(torch.tensor(input_ids + [0] * padding))
        graph.positions.copy_(torch.tensor(positions + [0] * padding))
        graph.slot_mapping.copy_(torch.tensor(slot_mapping + [scratch] * padding))
        graph.context_slots.copy_(slots.view(-1))
        graph.mask.copy_(mask[:, None, None, :])
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.logits = self._forward(graph)
        return graph.logits[:rows]

    def _forward(self, graph: _Graph) -> torch.Tensor:
        batch = graph.input_ids.shape[0]
        meta = AttentionMetadata(slot_mapping=graph.slot_mapping, num_decodes=batch, decode_slots=graph.context_slots,
                                 decode_mask=graph.mask, prefills=[])
        logits_indices = torch.arange(batch, device=self.device)
        return self.model(graph.input_ids, graph.positions, *self.caches, meta, logits_indices, *self.tables)

    def _capture(self, batch: int, context: int) -> _Graph:
        """Buffers for the shape, every row padding until a step fills them; on CUDA, its graph, recorded
        after warm-up runs on a side stream (which write only the scratch slot)."""
        device = self.device
        mask = torch.zeros(batch, 1, 1, context, dtype=torch.bool, device=device)
        mask[..., 0] = True
        graph = _Graph(
            input_ids=torch.zeros(batch, dtype=torch.long, device=device),
            positions=torch.zeros(batch, dtype=torch.long, device=device),
            slot_mapping=torch.full((batch,), self.scratch_slot, dtype=torch.long, device=device),
            context_slots=torch.full((batch * context,), self.scratch_slot, dtype=torch.long, device=device),
            mask=mask,
        )
        if self.capture:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._forward(graph)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph.graph = torch.cuda.CUDAGraph()
            # thread_local: the engine's thread captures while a worker's other threads may use CUDA
            with torch.cuda.graph(graph.graph, pool=self._pool, capture_error_mode="thread_local"):
                graph.logits = self._forward(graph)
            self._pool = graph.graph.pool()
        self._graphs[batch, context] = graph
        return graph
