"""The model runner: owns the model, the KV cache tensors and the sampler on one device."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.config import (BATCHED_WEIGHTS, DECODE_WEIGHTS, DEFAULT_BATCHED_WEIGHTS, DEFAULT_DECODE_WEIGHTS,
                                  CacheConfig)
from tandem.engine.model import cpu_kernels, crossover
from tandem.engine.model.cpu_kernels import BlockTables
from tandem.engine.model.decode_graphs import DecodeGraphs
from tandem.engine.model.llama import AttentionMetadata, CausalLM, PrefillChunk, rope_tables
from tandem.engine.model.sampler import Sample, sample, token_logprobs
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.utils import cdiv
from tandem.model_files import eos_token_ids
from tandem.structured import MaskTimer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(device: torch.device, dtype: str | None) -> torch.dtype:
    """The named dtype, or the device's natural one: bf16 (or fp16) on CUDA, fp16 on MPS, fp32 on CPU."""
    if dtype not in (None, "", "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolved_batched_weights(batched_weights: str, decode_weights: str) -> str:
    """What ``batched_weights`` means on this CPU: "auto" is bfloat16 where it is native, unless the decode
    weights are float32. bfloat16 is refused where it is not: oneDNN would not multiply it there."""
    if batched_weights == "bfloat16" and not native_bfloat16():
        raise ValueError("batched_weights bfloat16 needs a CPU that multiplies bfloat16 (AVX512-BF16 or AMX tiles); "
                         "this one does not: use float32 or auto")
    if batched_weights != "auto":
        return batched_weights
    return "bfloat16" if native_bfloat16() and decode_weights != "float32" else "float32"


class ModelRunner:
    """Runs scheduled steps of a Llama-family model over a paged KV cache.

    Args:
        model_dir: a Hugging Face model directory with safetensors weights.
        device: a torch device string ("cpu", "cuda", "cuda:1", "mps").
        dtype: weights and activations; None picks the device's natural dtype.
        cache: KV cache size.
        block_size: tokens per KV block (must match the scheduler's).
        max_model_len: context limit; defaults to the model's ``max_position_embeddings``.
        decode_weights: for a float32 model on the CPU, the weights that steps of few rows (decodes) read:
            "int8" keeps a second, quarter-size copy for them (each 32 columns of a row scaled to ±127),
            "float16" a half-size one, read by the CPU kernels (float32 where those cannot run here); "auto"
            keeps each weight that lies on a 4-bit grid in those 4 bits, exactly, and the others in int8;
            "float32": none.
        cuda_graphs: run steps of decodes alone through CUDA graphs (``decode_graphs``); None: on CUDA, where
            an eager step is bound by kernel launches (on an H200, 15.6 ms eager against 3.3 ms replayed at
            batch 1). Off CUDA the padded steps run eagerly, which only the tests want.
    """

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dtype: str | None = None,
        cache: CacheConfig = CacheConfig(),
        block_size: int = 16,
        max_model_len: int | None = None,
        decode_weights: str = DEFAULT_DECODE_WEIGHTS,
        cuda_graphs: bool | None = None,
        batched_weights: str = DEFAULT_BATCHED_WEIGHTS,
    ):
        from transformers import AutoConfig

        self.torch_device = torch.device(device)
        self.device = str(self.torch_device)
        self.dtype = resolve_dtype(self.torch_device, dtype)
        self.block_size = block_size
        if cuda_graphs is None:
            cuda_graphs = self.torch_device.type == "cuda"

        config = AutoConfig.from_pretrained(model_dir)
        self.config = config
        with torch.device("meta"):
            model = CausalLM(config)
        model.load_hf_state_dict(load_tensors(model_dir))
        self.model = model.to(device=self.torch_device, dtype=self.dtype).eval()
        if decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}; got {decode_weights!r}")
        if batched_weights not in BATCHED_WEIGHTS:
            raise ValueError(f"batched_weights must be one of {', '.join(BATCHED_WEIGHTS)}; got {batched_weights!r}")
        self.batched_dtype = self.prefill_attention_dtype = self.dtype
        kernels = None
        if self.torch_device.type == "cpu" and self.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            kernels = cpu_kernels.load()
            self.batched_dtype = getattr(torch, resolved_batched_weights(batched_weights, decode_weights))
            # bfloat16 prefill attention, where the kernels have it, is 2-2.5x faster than float32
            if self.batched_dtype == torch.bfloat16 and kernels is not None and kernels.prefill_attention_in_bfloat16:
                self.prefill_attention_dtype = torch.bfloat16
            self.model.use_cpu_kernels(kernels, None if decode_weights == "float32" else decode_weights,
                                       self.batched_dtype, self.prefill_attention_dtype)
        # the dtypes of the decode copy of the weights (as "uint4+int8"), or the model's where there is none
        self.decode_weights = self.model.decode_weights or str(self.dtype).removeprefix("torch.")
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.eos_token_ids = eos_token_ids(config, model_dir)

        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_block = 2 * config.num_hidden_layers * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        self.num_kv_blocks = cache.num_kv_blocks or max(1, cache.kv_cache_bytes // bytes_per_block)
        num_slots = self.num_kv_blocks * block_size + cuda_graphs  # the graphs' padding rows write past the blocks
        shape = (config.num_hidden_layers, num_slots, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.torch_device)
        self._block_rows: dict[str, _BlockRow] = {}
        self.cos_table, self.sin_table = rope_tables(config, self.max_model_len, self.dtype, self.torch_device)
        self._mask_timer = MaskTimer()
        self.decode_graphs = DecodeGraphs(self.model, self.k_cache, self.v_cache, self.cos_table, self.sin_table,
                                          num_slots - 1, self.max_model_len) if cuda_graphs else None
        if self.model.decode_weights:  # a CPU model with a decode copy of its weights
            combination = self._crossover_combination(kernels)
            self.model.decode_rows = crossover.measured_decode_rows(combination, self.decode_step, self.num_kv_blocks)
            if crossover.copy_may_win_prompts(self.model.decode_rows, self.decode_weights):
                self.model.prompt_rows = crossover.measured_prompt_rows(combination, self.prompt_layer)
        logger.info("model %s on %s (%s, %s weights for steps of up to %d rows and prompt chunks of up to %d, %s "
                    "for larger ones): %d KV blocks of %d tokens", model_dir, self.device, self.dtype,
                    self.decode_weights, self.model.decode_rows, self.model.prompt_rows, self.batched_dtype,
                    self.num_kv_blocks, block_size)

    def _crossover_combination(self, kernels: cpu_kernels.CpuKernels) -> dict:
        """What the step times that set ``decode_rows`` depend on."""
        config = self.config
        return {"cpu": cpu_kernels.cpu_info("model name"), "kernels": kernels.library.name,
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "decode_weights": self.decode_weights, "batched_weights": str(self.batched_dtype),
                "model": [config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                          config.num_attention_heads, config.num_key_value_heads, self.head_dim, config.vocab_size]}

    @torch.inference_mode()
    def decode_step(self, rows: int, decode_copy: bool) -> None:
        """One step of ``rows`` decodes, each at the end of a KV block of its own (blocks 0 to rows - 1, before
        any request holds them), on the decode copy of the weights or on the batched ones."""
        chosen = self.model.decode_rows, self.model.prompt_rows
        self.model.decode_rows, self.model.prompt_rows = rows if decode_copy else 0, 0
        size = self.block_size
        positions = torch.full((rows,), size - 1)
        tables = BlockTables([torch.tensor([row]) for row in range(rows)], [size] * rows, size)
        meta = AttentionMetadata(slot_mapping=torch.arange(rows) * size + size - 1, num_decodes=rows, decode_slots=None,
                                 decode_mask=None, prefills=[], decode_block_tables=tables)
        try:
            self.model(torch.zeros(rows, dtype=torch.long), positions, self.k_cache, self.v_cache, meta,
                       torch.arange(rows), self.cos_table, self.sin_table)
        finally:
            self.model.decode_rows, self.model.prompt_rows = chosen

    @torch.inference_mode()
    def prompt_layer(self, rows: int, decode_copy: bool) -> None:
        """A prompt chunk of ``rows`` tokens, with no cached prefix, through the first decoder layer: its norms,
        linears (on the decode copy of the weights or on the batched ones), activation, and attention over a scratch
        cache of its own, as the chunk's step runs them. Every token takes position 0: the time does not depend on
        it."""
        chosen, self.model.prompt_rows = self.model.prompt_rows, rows if decode_copy else 0
        keys, values = (torch.empty(rows, self.num_kv_heads, self.head_dim, dtype=self.dtype) for _ in range(2))
        meta = AttentionMetadata(slot_mapping=torch.arange(rows), num_decodes=0, decode_slots=None, decode_mask=None,
                                 prefills=[PrefillChunk(token_start=0, num_tokens=rows, context_slots=None, mask=None)])
        # constant rows: the values do not change the time, and drawing random ones would be timed beside them
        hidden = torch.ones(rows, self.config.hidden_size, dtype=self.dtype)
        try:
            self.model.layers[0](hidden, None, torch.zeros(rows, dtype=torch.long), self.cos_table, self.sin_table,
                                 keys, values, meta, self.model.layer_activations(rows))
        finally:
            self.model.prompt_rows = chosen

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> list[Sample | None]:
        items = output.scheduled
        if self._attends_as_decodes(sum(item.num_new_tokens for item in items)):
            decodes, prefills = items, []
        else:
            decodes = [item for item in items if item.num_new_tokens == 1]
            prefills = [item for item in items if item.num_new_tokens > 1]
        ordered = decodes + prefills

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: dict[int, int] = {}
        prompt_rows: dict[int, range] = {}  # the rows whose logits give a prompt token's log-probability
        for item in ordered:
            request, start, count = item.request, item.start, item.num_new_tokens
            if request.wants_prompt_logprobs:
                prompt_rows[id(item)] = range(len(input_ids), len(input_ids) + min(count, request.num_prompt_tokens - 1 - start))
            input_ids.extend(request.token_ids[start:start + count])
            positions.extend(range(start, start + count))
            slot_mapping.extend(self._slot(request.block_ids, p) for p in range(start, start + count))
            if item.samples:
                sample_rows[id(item)] = len(input_ids) - 1

        graphs = self.decode_graphs
        if graphs is not None and decodes and not prefills \
                and graphs.fits(len(decodes), max(item.start + 1 for item in decodes)):
            contexts = [self._context_slots(item.request.block_ids, item.start + 1) for item in decodes]
            logits = graphs.run(input_ids, positions, slot_mapping, contexts)
            rows = [sample_rows[id(item)] for item in items if item.samples]
            return self._sampled(items, logits[torch.tensor(rows, device=logits.device)])

        device = self.torch_device
        token_start = sum(item.num_new_tokens for item in decodes)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            num_decodes=token_start,
            decode_slots=None,
            decode_mask=None,
            prefills=[],
        )
        if decodes and self.model.uses_cpu_kernels:
            meta.decode_block_tables = self._decode_block_tables(decodes)
        elif decodes:
            meta.decode_slots, meta.decode_mask = self._decode_context(decodes)
        for item in prefills:
            meta.prefills.append(self._prefill_chunk(token_start, item.start, item.num_new_tokens,
                                                     item.request.block_ids))
            token_start += item.num_new_tokens

        rows = [sample_rows[id(item)] for item in items if item.samples]
        num_sampled = len(rows)
        for item in items:
            rows.extend(prompt_rows.get(id(item), ()))
        logits_indices = torch.tensor(rows, dtype=torch.long, device=device)
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.k_cache,
            self.v_cache,
            meta,
            logits_indices,
            self.cos_table,
            self.sin_table,
        )
        samples = self._sampled(items, logits[:num_sampled])
        return self._with_prompt_logprobs(items, samples, prompt_rows, logits[num_sampled:]) if prompt_rows else samples

    def take_mask_seconds(self) -> float:
        return self._mask_timer.take_step_seconds()

    @property
    def small_step_rows(self) -> int:
        """Steps of at most this many rows read the decode copy of the weights (0: there is none)."""
        return self.model.decode_rows

    @property
    def mask_seconds_per_row(self) -> float:
        return self._mask_timer.seconds_per_row

    def _sampled(self, items: list[ScheduledRequest], logits: torch.Tensor) -> list[Sample | None]:
        """Each item's sample, None for a chunk that samples none; ``logits``: a row for each item that
        samples, in order."""
        sampling = [item.request for item in items if item.samples]
        samples = iter(sample(logits, sampling, self.eos_token_ids, self._mask_timer) if sampling else [])
        return [next(samples) if item.samples else None for item in items]

    @staticmethod
    def _with_prompt_logprobs(items: list[ScheduledRequest], samples: list[Sample | None],
                              prompt_rows: dict[int, range], logits: torch.Tensor) -> list[Sample | None]:
        """``samples`` with the prompt log-probabilities of the items in ``prompt_rows``; ``logits``: their
        rows, in the order of ``items``."""
        merged, offset = [], 0
        for item, sample in zip(items, samples):
            rows = prompt_rows.get(id(item))
            if rows is None:
                merged.append(sample)
                continue
            request, start = item.request, item.start
            following = request.token_ids[start + 1:start + 1 + len(rows)]  # each row predicts the next token
            computed = token_logprobs(logits[offset:offset + len(rows)], following,
                                      request.sampling.prompt_logprobs) if rows else []
            offset += len(rows)
            merged.append(Sample(sample.token_id if sample else None, sample.logprobs if sample else None,
                                 tuple(computed), start))
        return merged

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _context_slots(self, block_ids: list[int], length: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids[: cdiv(length, self.block_size)], dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + torch.arange(self.block_size)).view(-1)
        return slots[:length]

    def _decode_context(self, decodes: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = [item.start + 1 for item in decodes]
        longest = max(lengths)
        slots = torch.zeros(len(decodes), longest, dtype=torch.long)
        for row, (item, length) in enumerate(zip(decodes, lengths)):
            slots[row, :length] = self._context_slots(item.request.block_ids, length)
        mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        device = self.torch_device
        return slots.view(-1).to(device), mask[:, None, None, :].to(device)

    def _attends_as_decodes(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows attends each of its tokens as a decode, prompt tokens too: with the
        CPU kernels, a step small enough to read the decode copy of the weights, so that every token attends
        its context in place through the block table, a shared prefix read once, and the decoder layers run in
        one call. Not where the CPU kernels attend prefill chunks in bfloat16: the same step runs in one call with
        each prompt chunk attended as a chunk, 2.5x faster than row by row in AMX tiles."""
        return self.model.uses_cpu_kernels and rows <= self.model.decode_rows \
            and not self.model.attends_prefills_in_bfloat16

    def _decode_block_tables(self, decodes: list[ScheduledRequest]) -> BlockTables:
        """A row per token of ``decodes`` (each attending its request's positions up to its own): each
        request's block ids as a tensor kept from step to step, so that a step converts only the blocks added
        since the last (one per ``block_size`` tokens) and its work does not grow with the context."""
        rows: dict[str, _BlockRow] = {}
        tables: list[torch.Tensor] = []
        lengths: list[int] = []
        for item in decodes:
            request = item.request
            row = self._block_rows.get(request.req_id)
            if row is None or row.source is not request.block_ids:  # new, or its blocks were reallocated
                row = _BlockRow(request.block_ids, torch.tensor(request.block_ids, dtype=torch.long))
            elif len(row.ids) < len(request.block_ids):
                added = torch.tensor(request.block_ids[len(row.ids):], dtype=torch.long)
                row.ids = torch.cat((row.ids, added))
            rows[request.req_id] = row
            tables.extend([row.ids] * item.num_new_tokens)
            lengths.extend(range(item.start + 1, item.start + item.num_new_tokens + 1))
        self._block_rows = rows
        return BlockTables(tables, lengths, self.block_size)

    def _prefill_chunk(self, token_start: int, start: int, count: int, block_ids: list[int]) -> PrefillChunk:
        """The chunk of ``count`` prompt tokens from position ``start`` that sits at row ``token_start`` of the
        step, attending to the positions before it in ``block_ids``."""
        if start == 0:
            return PrefillChunk(token_start, count, None, None)
        length, device = start + count, self.torch_device
        slots = self._context_slots(block_ids, length).to(device)
        if self.model.attends_prefills_in_kernels:
            return PrefillChunk(token_start, count, slots, None)
        query_positions = torch.arange(start, length)
        hidden = torch.arange(length)[None, :] > query_positions[:, None]
        # Additive, in the attention's dtype: a boolean mask would be converted to one in every layer.
        mask = torch.zeros(hidden.shape, dtype=self.prefill_attention_dtype).masked_fill_(hidden, float("-inf"))
        return PrefillChunk(token_start, count, slots, mask[None, None].to(device))

    @torch.inference_mode()
    def teacher_forced_logits(self, tokens: list[int], start: int, count: int) -> torch.Tensor:
        """Logits [count, vocab] after each of ``tokens[start:start + count]``, in one step over ``tokens[:start]``,
        which earlier calls put in the cache (position p in slot p, overwriting what was there). The step runs
        as a worker's step of ``count`` rows does: as decodes where ``_attends_as_decodes`` (one row always),
        else as a prefill chunk."""
        if start + count > self.num_kv_blocks * self.block_size:
            raise ValueError(f"{start + count} tokens do not fit the runner's {self.num_kv_blocks} KV blocks")
        device, block_ids = self.torch_device, list(range(self.num_kv_blocks))
        positions = torch.arange(start, start + count, device=device)
        as_decodes = count == 1 or self._attends_as_decodes(count)
        meta = AttentionMetadata(slot_mapping=positions, num_decodes=count if as_decodes else 0, decode_slots=None,
                                 decode_mask=None, prefills=[])
        if not as_decodes:
            meta.prefills.append(self._prefill_chunk(0, start, count, block_ids))
        elif self.model.uses_cpu_kernels:
            table = torch.tensor(block_ids)
            meta.decode_block_tables = BlockTables([table] * count, list(range(start + 1, start + count + 1)),
                                                   self.block_size)
        else:
            meta.decode_slots = torch.arange(start + 1, device=device)
            meta.decode_mask = torch.ones(1, 1, 1, start + 1, dtype=torch.bool, device=device)
        return self.model(torch.tensor(tokens[start:start + count], device=device), positions, self.k_cache,
                          self.v_cache, meta, torch.arange(count, device=device), self.cos_table, self.sin_table)


@dataclass
class _BlockRow:
    source: list[int]  # the request's block_ids list the tensor copies: appended to in place until reallocated
    ids: torch.Tensor


def load_tensors(model_dir: Path) -> dict:
    """Every tensor of the checkpoint in ``model_dir`` (single or sharded safetensors)."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    tensors: dict = {}
    for name in files:
        tensors.update(load_file(model_dir / name))
    return tensors
