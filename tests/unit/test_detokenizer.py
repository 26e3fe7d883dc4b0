"""Unit tests for incremental detokenization with stop strings."""

from __future__ import annotations

import random

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """Each token id stands for a byte string; decoding joins them and decodes UTF-8 with replacement.

    A piece registered as ``None`` is a special token: it decodes to nothing when special tokens are skipped.
    """

    def __init__(self):
        self.pieces: list[bytes | None] = []

    def ids(self, *pieces: bytes | str | None) -> list[int]:
        ids = []
        for piece in pieces:
            if isinstance(piece, str):
                piece = piece.encode()
            self.pieces.append(piece)
            ids.append(len(self.pieces) - 1)
        return ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        parts = []
        for token_id in token_ids:
            piece = self.pieces[token_id]
            if piece is None:
                if not skip_special_tokens:
                    parts.append(b"<special>")
                continue
            parts.append(piece)
        return b"".join(parts).decode("utf-8", errors="replace")


def feed(detokenizer: IncrementalDetokenizer, token_ids) -> list[str]:
    return [detokenizer.add_token(token_id) for token_id in token_ids]


def make(pieces, prompt=("The prompt: ",), stop_strings=()):
    tokenizer = ByteTokenizer()
    prompt_ids = tokenizer.ids(*prompt)
    output_ids = tokenizer.ids(*pieces)
    return IncrementalDetokenizer(tokenizer, prompt_ids, stop_strings), output_ids


def split_bytes(data: bytes, sizes) -> list[bytes]:
    pieces, start = [], 0
    for size in sizes:
        pieces.append(data[start:start + size])
        start += size
    assert start == len(data)
    return pieces


# --- plain streaming ---------------------------------------------------------------------------


def test_ascii_tokens_stream_immediately_without_stop_strings():
    detokenizer, ids = make(["Hel", "lo", " world"])
    assert feed(detokenizer, ids) == ["Hel", "lo", " world"]
    assert detokenizer.flush() == ""
    assert detokenizer.text == "Hello world"
    assert not detokenizer.stopped


def test_prompt_text_is_not_emitted():
    detokenizer, ids = make(["!"], prompt=("a", "b", "c", "d", "e", "f", "g"))
    assert feed(detokenizer, ids) == ["!"]
    assert detokenizer.text == "!"


def test_special_tokens_produce_no_text():
    detokenizer, ids = make(["a", None, "b"])
    assert feed(detokenizer, ids) == ["a", "", "b"]
    assert detokenizer.text == "ab"


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("é", [1, 1]),
        ("你好", [1, 2, 2, 1]),
        ("🙂", [1, 1, 1, 1]),
        ("a€b", [2, 2, 1]),  # a token that ends one character and starts another
        ("ça va 🚀!", [1, 2, 4, 2, 2, 1]),
    ],
)
def test_multibyte_characters_split_across_tokens_come_out_whole(text, sizes):
    pieces = split_bytes(text.encode(), sizes)
    detokenizer, ids = make(pieces)
    deltas = feed(detokenizer, ids)
    assert all(REPLACEMENT not in delta for delta in deltas), deltas
    assert "".join(deltas) + detokenizer.flush() == text
    assert detokenizer.text == text


def test_incomplete_character_is_held_until_completed():
    detokenizer, ids = make(split_bytes("x€".encode(), [2, 1, 1]))
    assert feed(detokenizer, ids) == ["", "", "x€"]


def test_flush_releases_an_incomplete_trailing_character_as_replacement():
    detokenizer, ids = make([b"ok", b"\xe2\x82"])  # the first two bytes of "€"
    assert feed(detokenizer, ids) == ["ok", ""]
    assert detokenizer.flush() == REPLACEMENT
    assert detokenizer.flush() == ""


def test_long_generation_keeps_streaming_past_the_context_window():
    words = [f"w{i} " for i in range(40)]
    detokenizer, ids = make(words)
    assert feed(detokenizer, ids) == words


# --- stop strings ------------------------------------------------------------------------------


def test_stop_string_spanning_tokens_is_never_emitted():
    detokenizer, ids = make(["Hi", " S", "T", "O", "P", " after"], stop_strings=["STOP"])
    deltas = feed(detokenizer, ids)
    emitted = "".join(deltas)
    assert detokenizer.stopped
    assert detokenizer.text == "Hi "
    assert emitted == "Hi "
    for i, delta in enumerate(deltas):
        assert not set(delta) & set("STOP"), f"delta {i} leaked part of the stop string: {delta!r}"
    assert deltas[-1] == "", "nothing is emitted after stopping"
    assert detokenizer.flush() == ""


def test_stop_string_inside_one_token_cuts_the_text_before_it():
    detokenizer, ids = make(["abc<END>def"], stop_strings=["<END>"])
    assert feed(detokenizer, ids) == ["abc"]
    assert detokenizer.stopped
    assert detokenizer.text == "abc"


def test_earliest_stop_string_wins():
    detokenizer, ids = make(["hello world"], stop_strings=["world", "lo"])
    assert feed(detokenizer, ids) == ["hel"]
    assert detokenizer.text == "hel"


def test_text_that_only_looks_like_a_stop_string_is_released_later():
    detokenizer, ids = make(["E", "N", "x", "y", "z"], stop_strings=["END"])
    deltas = feed(detokenizer, ids)
    assert deltas == ["", "", "E", "N", "x"]
    assert not detokenizer.stopped
    assert detokenizer.flush() == "yz"
    assert detokenizer.text == "ENxyz"


def test_flush_releases_the_held_back_tail():
    detokenizer, ids = make(["one ", "two"], stop_strings=["STOP!"])
    emitted = "".join(feed(detokenizer, ids))
    assert emitted == "one two"[:-4]
    assert detokenizer.flush() == "one two"[-4:]
    assert not detokenizer.stopped


def test_stop_string_with_multibyte_characters_split_across_tokens():
    pieces = split_bytes("ok «fin» more".encode(), [3, 1, 1, 2, 1, 1, 1, 5])
    detokenizer, ids = make(pieces, stop_strings=["«fin»"])
    deltas = feed(detokenizer, ids)
    assert detokenizer.stopped
    assert "".join(deltas) == "ok "
    assert all(REPLACEMENT not in delta for delta in deltas)


def test_empty_stop_string_is_ignored():
    detokenizer, ids = make(["a", "b"], stop_strings=[""])
    assert feed(detokenizer, ids) == ["a", "b"]
    assert not detokenizer.stopped


def test_randomized_streams_match_the_full_text():
    rng = random.Random(99)
    alphabet = ["a", "b", " ", "S", "T", "é", "€", "🙂", "你"]
    stop_strings = ["ST", "é🙂a"]
    stopped_runs = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        data = text.encode()
        cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randrange(0, 12))))
        pieces = [data[i:j] for i, j in zip([0] + cuts, cuts + [len(data)])]
        detokenizer, ids = make(pieces, stop_strings=stop_strings)

        positions = [p for p in (text.find(s) for s in stop_strings) if p >= 0]
        expected = text[:min(positions)] if positions else text

        emitted = ""
        for token_id in ids:
            delta = detokenizer.add_token(token_id)
            assert REPLACEMENT not in delta
            emitted += delta
            assert expected.startswith(emitted), (pieces, emitted)
        emitted += detokenizer.flush()
        assert emitted == expected, pieces
        assert detokenizer.stopped == bool(positions)
        stopped_runs += detokenizer.stopped
    assert 30 < stopped_runs < 270, "the generator should produce both stopped and unstopped streams"


def test_the_stop_string_can_be_kept_and_special_tokens_can_add_text():
    tokenizer = ByteTokenizer()
    ids = tokenizer.ids("Hello", " wor", "ld", None, "!")
    kept = IncrementalDetokenizer(tokenizer, [], ["wor"], include_stop_string=True)
    assert "".join(kept.add_token(token) for token in ids[:3]) + kept.flush() == "Hello wor"
    assert kept.stopped
    shown = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(shown.add_token(token) for token in ids) + shown.flush() == "Hello world<special>!"
    hidden = IncrementalDetokenizer(tokenizer, [])
    assert "".join(hidden.add_token(token) for token in ids) + hidden.flush() == "Hello world!"
