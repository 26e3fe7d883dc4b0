"""The router's torch-free tokenizer encodes prompts and chats exactly as transformers' tokenizer does."""

from __future__ import annotations

import json

import pytest

from tandem.tokenizer import PromptTokenizer, load_prompt_tokenizer, load_tokenizer
from tests.models import CORPUS, build_tokenizer

TEXTS = [*CORPUS, " leading space", "a\n\n\tb  c", "<s>user\nhi</s> and <unk>", "x</s>"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q </s>"},
     {"role": "assistant", "content": "A"}, {"role": "user", "content": "héllo 🙂"}],
]


def assert_same_ids(model_dir, texts=TEXTS):
    expected, actual = load_tokenizer(model_dir), load_prompt_tokenizer(model_dir)
    assert isinstance(actual, PromptTokenizer)
    for text in texts:
        assert actual(text)["input_ids"] == expected(text)["input_ids"], text
    assert actual.chat_template == expected.chat_template
    if expected.chat_template is None:
        return
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            arguments = {"add_generation_prompt": add_generation_prompt, "tokenize": True, "return_dict": False}
            assert (actual.apply_chat_template(conversation, **arguments)
                    == expected.apply_chat_template(conversation, **arguments))
            arguments = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
            assert (actual.apply_chat_template(conversation, **arguments)
                    == expected.apply_chat_template(conversation, **arguments))


def edit_config(model_dir, **changes):
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_a_saved_tokenizer_encodes_text_and_chats_identically(tmp_path):
    build_tokenizer(tmp_path)
    assert_same_ids(tmp_path)


def test_bos_and_eos_flags_in_the_config_change_nothing_as_in_transformers(tmp_path):
    build_tokenizer(tmp_path)
    edit_config(tmp_path, add_bos_token=True, add_eos_token=True)
    assert_same_ids(tmp_path)


def test_a_tokenizer_json_without_post_processor_is_encoded_identically(tmp_path):
    build_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "post_processor": None}))
    assert_same_ids(tmp_path)


def test_a_special_token_missing_from_tokenizer_json_is_added(tmp_path):
    build_tokenizer(tmp_path)
    edit_config(tmp_path, pad_token="<pad>")
    assert_same_ids(tmp_path, [*TEXTS, "a <pad> b"])


def test_the_template_sees_special_tokens_by_name(tmp_path):
    build_tokenizer(tmp_path)
    edit_config(tmp_path, image_token="<image>", extra_special_tokens={"audio_token": "<audio>"})
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ image_token }}{{ m['content'] }}{{ audio_token }}{{ eos_token }}"
        "{% endfor %}")
    assert_same_ids(tmp_path, [*TEXTS, "a<image>b<audio>"])


def test_extra_special_tokens_are_added_and_never_split(tmp_path):
    build_tokenizer(tmp_path)
    edit_config(tmp_path, extra_special_tokens=["<tool>", "</tool>"])
    assert_same_ids(tmp_path, [*TEXTS, "x<tool>y</tool>"])


def test_a_model_without_a_chat_template_has_none(tmp_path):
    build_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    tokenizer = load_prompt_tokenizer(tmp_path)
    assert tokenizer.chat_template is None
    assert_same_ids(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("change", ["tokenizer_class", "special_tokens_map.json", "added_tokens_decoder"])
def test_tokenizers_that_transformers_rebuilds_or_merges_fall_back_to_transformers(tmp_path, change):
    build_tokenizer(tmp_path)
    if change == "tokenizer_class":
        edit_config(tmp_path, tokenizer_class="GPT2Tokenizer")
    elif change == "special_tokens_map.json":
        (tmp_path / change).write_text(json.dumps({"pad_token": "<pad>"}))
    else:
        edit_config(tmp_path, added_tokens_decoder={})
    assert not isinstance(load_prompt_tokenizer(tmp_path), PromptTokenizer)


@pytest.mark.model
def test_the_default_model_encodes_identically():
    from tandem.model_files import resolve_model

    assert_same_ids(resolve_model(None), [*TEXTS, "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> x"])
