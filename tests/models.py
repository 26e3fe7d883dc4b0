"""Tiny random-weight models built in code, so tests need neither the real model nor network."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefix caching reuses blocks of a shared system prompt between requests.",
    "héllo wörld, ça va? naïve café crème brûlée",
    "你好，世界。分页注意力与前缀缓存。",
    "emoji: 🙂🚀✨ mixed with text",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
]


def build_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    fast.save_pretrained(directory)
    return fast


def on_q4_1_grid(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a Q4_1 GGUF file holds it: each 32 columns of a row as 16 levels from the group's minimum in
    steps of a 15th of its range, the minimum and the step rounded to float16."""
    groups = weight.reshape(-1, 32)
    minimum = groups.amin(dim=1, keepdim=True).half().float()
    step = ((groups.amax(dim=1, keepdim=True) - minimum) / 15).half().float()
    levels = torch.round((groups - minimum) / step).clamp(0, 15)
    return (levels * step + minimum).view(weight.shape)


def build_tiny_model(directory: Path, family: str = "llama", seed: int = 0, head_dim: int = 16,
                     context_length: int = 1024, q4_1: bool = False) -> Path:
    """Save a tiny random-weight causal LM of ``family`` ("llama" or "qwen2") with a tokenizer; with ``q4_1``,
    every linear layer's weight on the grid of a Q4_1 file (``on_q4_1_grid``), as a model dequantized from one.

    Its two layers have 4 query and 2 key-value heads of ``head_dim`` each (vLLM's CPU attention takes 64,
    not 16).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        raise ValueError(family)
    if q4_1:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(on_q4_1_grid(module.weight))
    model.save_pretrained(directory)
    return directory
