"""Tokenizers: transformers' own for the workers, and a torch-free one for processes that only encode.

Importing any of transformers' tokenizer classes imports torch (transformers 5.17 loads its GGUF
reader, which imports torch, when the tokenizers backend is imported), and torch costs a process
hundreds of MiB. The router only turns prompts and chats into token ids, so it uses
``PromptTokenizer``: the ``tokenizers`` library on the model's ``tokenizer.json``, and chat
templates rendered by transformers' own renderer (``render_jinja_template``, which imports no torch).
The Rust routers of TGI and SGLang likewise read ``tokenizer.json`` with the tokenizers library and
render the chat template with a Jinja engine of their own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# tokenizer_config.json classes whose tokenizer is tokenizer.json as saved, nothing rebuilt in code.
_PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Files and config entries from before transformers 5, whose merging rules stay with transformers.
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(model_dir):
    """transformers' tokenizer for ``model_dir`` (encodes, decodes, chat templates); imports torch."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, clean_up_tokenization_spaces=False)


def load_prompt_tokenizer(model_dir):
    """A tokenizer that encodes prompts and chats exactly as ``load_tokenizer``'s does, without torch.

    That holds for a tokenizer as transformers 5 saves it: ``tokenizer.json`` plus a plain
    ``tokenizer_config.json``. Any other (a model-specific ``tokenizer_class`` that transformers
    rebuilds in code, no ``tokenizer.json``, legacy special-token files) gets ``load_tokenizer``'s,
    so the ids always match what the workers compute.
    """
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "tokenizer_config.json")
    tokenizer_class = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    legacy = [name for name in _LEGACY_FILES if (model_dir / name).exists()] + (
        ["added_tokens_decoder"] if "added_tokens_decoder" in config else [])
    if (model_dir / "tokenizer.json").is_file() and tokenizer_class in _PLAIN_TOKENIZER_CLASSES and not legacy:
        return PromptTokenizer(model_dir, config)
    logger.info("the tokenizer (%s%s) needs transformers' own loader, which imports torch",
                tokenizer_class, "".join(f", {name}" for name in legacy))
    return load_tokenizer(model_dir)


class PromptTokenizer:
    """Encodes text and chats like transformers' ``TokenizersBackend`` loaded from the same directory.

    ``tokenizer(text)["input_ids"]`` and ``apply_chat_template(...)`` return what transformers'
    tokenizer returns for the same arguments; ``chat_template`` is the model's template (a dict of
    named templates when it has several), or None.
    """

    def __init__(self, model_dir: Path, config: dict):
        from tokenizers import AddedToken, Tokenizer, processors

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer.no_truncation()  # transformers encodes one prompt with neither, whatever tokenizer.json says
        tokenizer.no_padding()
        # Named special tokens, as PreTrainedTokenizerBase reads them: the standard names, any other
        # "*_token" string, and model_specific_special_tokens or a dict of extra_special_tokens.
        named = {key: _token_text(value) for key, value in config.items()
                 if key in _SPECIAL_TOKEN_NAMES or (key.endswith("_token") and isinstance(_token_text(value), str))}
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        for more in (config.get("model_specific_special_tokens") or {}, extra if isinstance(extra, dict) else {}):
            named.update({key: _token_text(value) for key, value in more.items()})
        if isinstance(extra, dict):
            extra = []
        self.special_tokens_map = {name: token for name, token in named.items() if token is not None}
        # Special tokens named in the config but missing from tokenizer.json are added, as transformers does.
        present = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
        missing = [token for token in (*self.special_tokens_map.values(), *map(_token_text, extra))
                   if token is not None and token not in present]
        if missing:
            tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in missing])
        # With a tokenizer.json, transformers ignores add_bos_token/add_eos_token and keeps its post-processor,
        # or, where it has none, sets one that adds nothing (TokenizersBackend.update_post_processor).
        if tokenizer.post_processor is None:
            tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        self._tokenizer = tokenizer
        self.chat_template = _chat_template(model_dir, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True, chat_template: str | None = None,
                            **kwargs) -> str | list[int] | dict[str, list[int]]:
        """Render one conversation with the model's template; token ids unless ``tokenize`` is False.

        As transformers does: the template sees the special tokens by name plus ``kwargs``, and the
        rendered text is encoded without adding special tokens (the template writes its own).
        """
        from transformers.utils.chat_template_utils import render_jinja_template

        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        rendered, _ = render_jinja_template(
            conversations=[conversation], chat_template=self._template(chat_template),
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs},
        )
        if not tokenize:
            return rendered[0]
        output = self(rendered[0], add_special_tokens=False)
        return output if return_dict else output["input_ids"]

    def _template(self, chat_template: str | None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if "default" not in templates:
                    raise ValueError(f"this model has several chat templates and no default: {sorted(templates)}")
                return templates["default"]
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template")
        return templates


def _chat_template(model_dir: Path, config: dict) -> str | dict[str, str] | None:
    """The template(s) transformers loads: chat_template.jinja and additional_chat_templates/ before the config's."""
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        templates.update({path.stem: path.read_text(encoding="utf-8") for path in sorted(extra_dir.glob("*.jinja"))})
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return template


def _token_text(token) -> str | None:
    """A special token as the config writes it: a string, or an AddedToken's dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
