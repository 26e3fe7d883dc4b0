"""A compact Llama / Qwen2 decoder that runs directly on the paged KV cache.

Why our own module rather than transformers' model with a custom attention function: one engine
step is a flat batch of tokens from many requests (decodes and prefill chunks together). Here every
projection is one matrix multiply over all of them, keys and values are written straight into the
block pool, and attention gathers each request's context from its block table, with no per-request
cache objects and no padding of the projections. The weights are the Hugging Face checkpoint's,
loaded by name; numerics follow transformers' implementation (fp32 RMSNorm and rotary tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model.cpu_kernels import BlockTables, CpuKernels, DecodeLayers

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
# The most bytes of float32 gate and up products a CPU step makes at once through the decode copy: glibc's malloc
# keeps freed memory for the next allocation up to 32 MiB, and maps a larger one afresh and faults it in a page
# at a time, at every layer.
MLP_PRODUCT_BYTES = 32 << 20
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the cache and what each attends to.

    Decode rows come first in the flat batch and attend together: a request's one new token, or, in a step
    small enough (``ModelRunner._attends_as_decodes``), any token, each over its positions up to its own;
    through the CPU kernel, which reads the cache in place by block table, or else through a padded gather.
    Each prefill chunk after them attends on its own; where the CPU kernels attend prefill chunks, a step small
    enough runs them, its decodes and all its layers in one kernel call.
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decodes: int
    decode_slots: torch.Tensor | None  # gather: [num_decodes * max_context] context slots, padded
    decode_mask: torch.Tensor | None  # gather: [num_decodes, 1, 1, max_context] True where attended
    prefills: list["PrefillChunk"]
    decode_block_tables: BlockTables | None = None  # kernel: each decode's blocks and positions attended


@dataclass
class PrefillChunk:
    token_start: int  # offset of the chunk in the flat batch
    num_tokens: int
    context_slots: torch.Tensor | None  # [context_len] slots of the cached prefix + chunk; None when no prefix
    # [1, 1, num_tokens, context_len] causal with the prefix offset, 0 or -inf, for torch's attention; None
    # without a prefix, or where the CPU kernels attend prefill chunks (they take no mask)
    mask: torch.Tensor | None

    def slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The cache slots of the chunk's whole context, its own positions last."""
        if self.context_slots is not None:
            return self.context_slots
        return slot_mapping[self.token_start:self.token_start + self.num_tokens]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.cpu_kernels: CpuKernels | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized ``x + residual`` (``x`` without one), in ``out_dtype`` (None: ``x``'s), and that sum:
        the next residual."""
        if self.cpu_kernels is not None:
            normed = self.cpu_kernels.rms_norm(x, residual, self.weight, self.eps, out_dtype or x.dtype)
            return normed, x if residual is None else residual
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        normed = x.to(torch.float32)
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype)).to(out_dtype or dtype), x


def rope_tables(config, max_positions: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim], computed as transformers computes them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(_STATIC_ROPE_TYPES)})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype=dtype, device=device), (emb.sin() * scaling).to(dtype=dtype, device=device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False)))
        self.scale = self.head_dim ** -0.5
        self.cpu_kernels: CpuKernels | None = None
        self.prefill_dtype: torch.dtype | None = None  # prefill chunks' attention in it, where not the model's
        self.prefill_kernel = False  # prefill chunks attend through the CPU kernels, in prefill_dtype or float32

    def forward(self, x, positions, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                activations: torch.dtype | None = None) -> torch.Tensor:
        """``cos``, ``sin``: with the CPU kernels, the whole tables [positions, head_dim], which the kernel
        indexes; without, each token's rows [tokens, 1, head_dim]. ``activations``: the dtype the output
        projection takes its rows in (None: the model's)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.cpu_kernels is not None:
            self.cpu_kernels.rope_and_cache(qkv, self.num_heads, self.num_kv_heads, positions, cos, sin,
                                            meta.slot_mapping, k_cache, v_cache)
        q, k, v = (part.view(num_tokens, -1, self.head_dim) for part in qkv.split(self.split, dim=-1))
        if self.cpu_kernels is None:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape, dtype=activations or q.dtype, device=q.device)
        n = meta.num_decodes
        if n and meta.decode_block_tables is not None:
            out[:n] = self.cpu_kernels.decode_attention(q[:n], k_cache, v_cache, meta.decode_block_tables, self.scale)
        elif n:
            keys = k_cache.index_select(0, meta.decode_slots).view(n, -1, self.num_kv_heads, self.head_dim)
            values = v_cache.index_select(0, meta.decode_slots).view(n, -1, self.num_kv_heads, self.head_dim)
            out[:n] = F.scaled_dot_product_attention(
                q[:n].unsqueeze(2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=meta.decode_mask,
                scale=self.scale,
                enable_gqa=True,
            ).squeeze(2)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            if self.prefill_kernel:  # out in the kernel's dtype; rows in another take it converted
                kernel_dtype = self.prefill_dtype or q.dtype
                converted = out.dtype != kernel_dtype
                staged = torch.empty(q[rows].shape, dtype=kernel_dtype) if converted else out[rows]
                self.cpu_kernels.prefill_attention(q[rows], k_cache, v_cache, chunk.slots(meta.slot_mapping),
                                                   self.scale, staged)
                if converted:
                    out[rows] = staged
                continue
            if chunk.context_slots is None:
                keys, values = k[rows], v[rows]
            else:
                keys = k_cache.index_select(0, chunk.context_slots)
                values = v_cache.index_select(0, chunk.context_slots)
            queries = q[rows]
            if self.prefill_dtype is not None:
                queries, keys, values = (part.to(self.prefill_dtype) for part in (queries, keys, values))
            out[rows] = F.scaled_dot_product_attention(
                queries.transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=self.scale,
                enable_gqa=True,
            ).squeeze(0).transpose(0, 1)
        return self.o_proj(out.view(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.cpu_kernels: CpuKernels | None = None
        # the rows of a long prompt chunk that pass the decode copy at once: a power of two, as its kernels' blocks
        fitting_rows = max(1, MLP_PRODUCT_BYTES // (2 * config.intermediate_size * 4))
        self.copy_block_rows = 1 << fitting_rows.bit_length() - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            if len(x) > self.copy_block_rows and self.gate_up_proj.reads_copy(len(x)):
                return torch.cat([self(block) for block in x.split(self.copy_block_rows)])
            return self.down_proj(self.gate_up_proj.silu_and_mul(x, self.cpu_kernels))
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, cos, sin, k_cache, v_cache, meta, activations=None):
        """This layer's output and the residual stream before it: their sum is the hidden state.
        ``activations``: the dtype its linears take their rows in (None: the model's)."""
        x, residual = self.input_layernorm(x, residual, activations)
        x = self.self_attn(x, positions, cos, sin, k_cache, v_cache, meta, activations)
        x, residual = self.post_attention_layernorm(x, residual, activations)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """Llama-family causal LM over a flat batch of tokens with a paged KV cache."""

    def __init__(self, config):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.decode_layers: DecodeLayers | None = None  # with the CPU kernels and float16 weights
        self._decode_rows = self._prompt_rows = 0
        # what the packed linears of the decoder layers and of the output head read them by
        self._layer_copy, self._head_copy = CopyRows(), CopyRows()
        self._batched_activations: torch.dtype | None = None  # bfloat16 with bfloat16 batched weights

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] for the selected tokens of the flat batch.

        Args:
            input_ids, positions: [num_tokens] the step's new tokens and their positions.
            k_cache, v_cache: [num_layers, num_slots, num_kv_heads, head_dim].
        """
        x, residual = self.embed_tokens(input_ids), None
        if self.decode_layers is not None and len(input_ids) <= self._decode_rows \
                and (meta.decode_block_tables is not None or not meta.num_decodes) \
                and (not meta.prefills or self.attends_prefills_in_bfloat16):
            chunks = [(chunk.token_start, chunk.num_tokens, chunk.slots(meta.slot_mapping)) for chunk in meta.prefills]
            x, residual = self.cpu_kernels.decode_layers(self.decode_layers, x, positions, cos_table, sin_table,
                                                         meta.slot_mapping, k_cache, v_cache, meta.decode_block_tables,
                                                         chunks)
        else:
            if self.uses_cpu_kernels:
                cos, sin = cos_table, sin_table
            else:
                cos = cos_table.index_select(0, positions).unsqueeze(1)
                sin = sin_table.index_select(0, positions).unsqueeze(1)
            activations = self.layer_activations(len(input_ids))
            for index, layer in enumerate(self.layers):
                x, residual = layer(x, residual, positions, cos, sin, k_cache[index], v_cache[index], meta,
                                    activations)
        hidden = (x + residual).index_select(0, logits_indices)
        return self.lm_head(self.norm(hidden)[0])

    def layer_activations(self, num_tokens: int) -> torch.dtype | None:
        """The dtype the decoder layers make a step's rows in, where not the model's: bfloat16 where the step's
        linears multiply bfloat16 batched weights, so that each row is rounded where it is made."""
        return self._batched_activations if num_tokens > self._layer_copy.rows else None

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face checkpoint's tensors, fusing q/k/v and gate/up projections."""
        state: dict[str, torch.Tensor] = {}
        prefix = "model."
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith(prefix):
                state[name[len(prefix):]] = tensor
            elif name == "lm_head.weight" and not self.tie_word_embeddings:
                state[name] = tensor
        for i in range(len(self.layers)):
            attn = f"layers.{i}.self_attn."
            for kind in ("weight", "bias"):
                parts = [state.pop(f"{attn}{p}_proj.{kind}", None) for p in ("q", "k", "v")]
                if all(part is not None for part in parts):
                    state[f"{attn}qkv_proj.{kind}"] = torch.cat(parts, dim=0)
                mlp = f"layers.{i}.mlp."
                gate, up = state.pop(f"{mlp}gate_proj.{kind}", None), state.pop(f"{mlp}up_proj.{kind}", None)
                if gate is not None and up is not None:
                    state[f"{mlp}gate_up_proj.{kind}"] = torch.cat((gate, up), dim=0)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if self.tie_word_embeddings:
            missing = [name for name in missing if name != "lm_head.weight"]
            self.lm_head.weight = self.embed_tokens.weight
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def use_cpu_kernels(self, kernels: CpuKernels | None, decode_weights: str | None,
                        batched_dtype: torch.dtype = torch.float32, prefill_attention_dtype: torch.dtype | None = None
                        ) -> None:
        """For a float32 model on a CPU with oneDNN: pack every linear layer's weight for oneDNN in
        ``batched_dtype`` (float32 or bfloat16), run prefill chunks' attention in ``prefill_attention_dtype``
        (None: float32; through ``kernels.prefill_attention`` where it takes this head layout in that dtype), and,
        with ``kernels`` that take this model's head layout, run
        norms, rotary embeddings, cache writes, activations and decode attention (the runner then passes block
        tables) through them, and, with ``decode_weights`` (float16, int8 or auto: ``CpuKernels.decode_dtype``), the
        linears of steps of few rows, on a copy of the weights in it; then a step of decodes alone runs all the
        decoder layers in one kernel call."""
        attention = self.layers[0].self_attn
        usable = kernels is not None and kernels.supports_attention(
            attention.num_heads, attention.num_kv_heads, attention.head_dim)
        self._batched_activations = batched_dtype if batched_dtype != torch.float32 else None
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    decode_dtype = kernels.decode_dtype(child.weight, decode_weights) \
                        if usable and decode_weights else None
                    packed = PackedLinear(child, kernels if decode_dtype is not None else None, decode_dtype,
                                          batched_dtype, batched_kernels=kernels,
                                          gated=usable and name == "gate_up_proj")
                    packed.copy_rows = self._head_copy if child is self.lm_head else self._layer_copy
                    setattr(module, name, packed)
            if usable and isinstance(module, (RMSNorm, Attention, MLP)):
                module.cpu_kernels = kernels
            if isinstance(module, Attention):
                module.prefill_dtype = prefill_attention_dtype
                module.prefill_kernel = usable and kernels.attends_prefills(
                    module.num_heads, module.num_kv_heads, module.head_dim, prefill_attention_dtype or torch.float32)
        linears = [dict(zip(DecodeLayers.LINEARS, (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)))
                   for layer in self.layers]
        if usable and all(linear.decode_weight is not None for named in linears for linear in named.values()):
            tables = [{"input_norm": layer.input_layernorm.weight,
                       "post_attention_norm": layer.post_attention_layernorm.weight,
                       **{name: linear.decode_weight for name, linear in named.items()},
                       **{f"{name}_bias": linear.bias for name, linear in named.items()}}
                      for layer, named in zip(self.layers, linears)]
            self.decode_layers = DecodeLayers(tables, self.config.hidden_size, attention.num_heads,
                                              attention.num_kv_heads, attention.head_dim,
                                              self.config.intermediate_size, self.norm.eps, attention.scale)

    @property
    def decode_weights(self) -> str | None:
        """The dtypes of the decode copy of the linears' weights (as "uint4+int8"), or None without one."""
        dtypes = {str(module.decode_weight.dtype).removeprefix("torch.") for module in self.modules()
                  if isinstance(module, PackedLinear) and module.decode_weight is not None}
        return "+".join(sorted(dtypes, reverse=True)) or None

    @property
    def decode_rows(self) -> int:
        """The most rows a step may have and still read the decode copy of the weights (a step of decodes
        alone then runs every layer in one kernel call); larger steps read the batched weights, unless
        ``prompt_rows`` says otherwise. 0 until set, which the runner does with the crossover it measures
        (``crossover.measured_decode_rows``)."""
        return self._decode_rows

    @decode_rows.setter
    def decode_rows(self, rows: int) -> None:
        self._decode_rows = rows
        self._share_copy_rows()

    @property
    def prompt_rows(self) -> int:
        """The most rows a step may have and still multiply the decoder layers' weights by their decode copy, where
        that is more than ``decode_rows``: the copy's kernel beats the batched weights on prompt chunks too (uint4,
        multiplied in integers). 0 (only ``decode_rows``) until the runner sets it from the crossover it measures
        (``crossover.measured_prompt_rows``). The output head keeps to ``decode_rows``."""
        return self._prompt_rows

    @prompt_rows.setter
    def prompt_rows(self, rows: int) -> None:
        self._prompt_rows = rows
        self._share_copy_rows()

    def _share_copy_rows(self) -> None:
        self._layer_copy.rows = max(self._decode_rows, self._prompt_rows)
        self._head_copy.rows = self._decode_rows

    @property
    def cpu_kernels(self) -> CpuKernels | None:
        return self.norm.cpu_kernels

    @property
    def uses_cpu_kernels(self) -> bool:
        return self.cpu_kernels is not None

    @property
    def attends_prefills_in_kernels(self) -> bool:
        return self.layers[0].self_attn.prefill_kernel

    @property
    def attends_prefills_in_bfloat16(self) -> bool:
        """Whether prefill chunks attend in the kernels' bfloat16 ``prefill_attention`` (the builds with
        AVX512-BF16), which ``decode_layers`` calls for a small step's prompt chunks too."""
        return self.attends_prefills_in_kernels and self.layers[0].self_attn.prefill_dtype == torch.bfloat16


class CopyRows:
    """The most rows a step may have and still multiply by the decode copy of the weights, one object shared by
    every linear it governs, so that setting it touches none of them."""

    __slots__ = ("rows",)

    def __init__(self, rows: int = 0):
        self.rows = rows


class PackedLinear(nn.Module):
    """A linear layer whose weight is laid out once for CPU matmuls.

    A decode step multiplies every weight matrix by only a handful of rows. Plain BLAS repacks the
    weight on every call, which costs about as much as the multiply; the pre-reordered weight makes
    these matmuls 1.3-2x faster on AVX2 CPUs, and is no slower for large prefill chunks. The batched weight is
    float32, reordered for oneDNN, or ``batched_dtype`` bfloat16, multiplied by the rows rounded to bfloat16 with
    float32 sums: in AMX tiles through ``batched_kernels`` where they take it (the AMX build), else reordered for
    oneDNN. With ``decode_kernels``, steps of at most ``decode_rows`` rows multiply by a copy of the weight in
    ``decode_dtype`` (float16, int8 with a scale per group of columns, or uint4 with a step and a minimum per group)
    through their ``linear`` instead: there the multiply is bound by reading the weights, and the copy has half,
    a quarter or an eighth of the bytes.
    """

    def __init__(self, linear: nn.Linear, decode_kernels: CpuKernels | None = None,
                 decode_dtype: torch.dtype | None = torch.float16, batched_dtype: torch.dtype = torch.float32,
                 decode_rows: int = 0, batched_kernels: CpuKernels | None = None, gated: bool = False):
        super().__init__()
        self.copy_rows = CopyRows(decode_rows)
        weight = linear.weight.detach()
        self.batched_dtype = batched_dtype
        tiles = batched_dtype == torch.bfloat16 and batched_kernels is not None \
            and batched_kernels.tiles_bfloat16(linear.in_features)
        self.batched_kernels = batched_kernels if tiles else None
        # a gate projection's rows then its up projection's, multiplied and activated in one pass over the tiles
        self.gated_tiles = tiles and gated and linear.out_features % 32 == 0
        self.tiled_weight = batched_kernels.pack_bfloat16(weight, self.gated_tiles) if tiles else None
        self.packed_weight = None if tiles else torch.ops.mkldnn._reorder_linear_weight(weight.to(batched_dtype), 8)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_features = linear.out_features
        self.decode_kernels = decode_kernels if decode_dtype is not None else None
        self.decode_weight = None if self.decode_kernels is None else self.decode_kernels.pack(weight, decode_dtype)

    @property
    def decode_rows(self) -> int:
        return self.copy_rows.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` in float32."""
        if self.tiled_weight is not None and not self.gated_tiles and x.shape[0] > self.decode_rows:
            return self._in_tiles(x, torch.float32)
        return self.product(x).float()

    def silu_and_mul(self, x: torch.Tensor, kernels: CpuKernels) -> torch.Tensor:
        """silu(gate) ⊙ up of ``x``'s projections by this layer, a gate projection's rows then its up projection's:
        in one pass where the step multiplies the gated tiles, else ``kernels.silu_and_mul`` of ``product``."""
        if self.gated_tiles and x.shape[0] > self.decode_rows:
            return self._in_tiles(x, torch.bfloat16)
        return kernels.silu_and_mul(self.product(x))

    def reads_copy(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows multiplies the decode copy of the weight."""
        return self.decode_kernels is not None and rows <= self.decode_rows

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias``: in bfloat16 where the step multiplies bfloat16 batched weights (in AMX tiles, or
        without a bias), else in float32. ``x`` may be bfloat16 there too."""
        if self.reads_copy(x.shape[0]):
            return self.decode_kernels.linear(x, self.decode_weight, self.bias)
        if self.tiled_weight is not None:
            if self.gated_tiles:
                raise ValueError("the rows of a step this large take a gated layer through silu_and_mul")
            return self._in_tiles(x, torch.bfloat16)
        if self.batched_dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.batched_dtype), self.packed_weight, None, "none", [], "")
        return y if self.bias is None else y.float() + self.bias

    def _in_tiles(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self.batched_kernels.linear_bfloat16(x.to(torch.bfloat16), self.tiled_weight, self.bias, out_dtype)
