"""Structured output: a request's output held to a JSON schema, any JSON object, a regular expression, a
choice of strings or an EBNF grammar, through xgrammar. JSON is held to one layout (``{"a": 1, "b": [2]}``),
so no token goes to whitespace.

A spec is checked where a request enters (``grammar``: the grammar alone, no tokenizer needed, cached by
spec), so a schema that does not compile is refused naming its field. An engine compiles it for its
tokenizer once (``Grammars``, cached by spec) and gives each request a ``Constraint``: before each token the
sampler masks every token the grammar does not allow next (``apply``), and the constraint then advances by
the token drawn. xgrammar is imported on first use, so a process that never sees a spec never loads it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[16:50:26] /project/cpp/file.cc:83: "
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 65536
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: ``kind`` (one of ``KINDS``) and its ``spec``: the schema as JSON
    text, the regular expression, the EBNF grammar (GBNF), or the choices; none for ``json_object``."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError("structured_output", f"must be one of {', '.join(KINDS)}; got {self.kind!r}")
        grammar(self)

    @property
    def field(self) -> str:
        return f"structured_output.{self.kind}"


def preload() -> None:
    """Import xgrammar on a thread of its own (it takes seconds), so that the first request with a spec does not
    hold up a service's event loop."""
    threading.Thread(target=lambda: __import__("xgrammar"), name="xgrammar-import", daemon=True).start()


@functools.lru_cache(maxsize=256)
def grammar(output: StructuredOutput):
    """``output`` as an xgrammar ``Grammar``.

    Raises:
        InvalidRequestError: the spec is invalid or too large; the field is named.
    """
    import xgrammar

    spec = output.spec
    size = sum(map(len, spec)) if isinstance(spec, tuple) else len(spec)
    if size > MAX_SPEC_CHARS:
        raise InvalidRequestError(output.field, f"at most {MAX_SPEC_CHARS} characters")
    try:
        if output.kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if output.kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(_schema_text(spec, output.field), any_whitespace=False)
        if output.kind == "regex":
            return xgrammar.Grammar.from_regex(spec)
        if output.kind == "choice":
            if not spec or len(spec) > MAX_CHOICES or not all(spec):
                raise InvalidRequestError(output.field, f"must be 1 to {MAX_CHOICES} non-empty strings")
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(choice) for choice in spec))
        return xgrammar.Grammar.from_ebnf(spec)
    except InvalidRequestError:
        raise
    except Exception as exc:  # xgrammar's errors for a spec it cannot compile
        lines = str(exc).strip().splitlines()
        reason = _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
        raise InvalidRequestError(output.field, f"does not compile: {reason}") from None


def _schema_text(spec: str, field: str) -> str:
    try:
        schema = json.loads(spec)
    except (TypeError, ValueError):
        raise InvalidRequestError(field, "must be a JSON schema (an object, as JSON text)") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(field, "must be a JSON schema (an object)")
    return spec


class Grammars:
    """An engine's compiled grammars for its tokenizer, cached by spec.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (its logits' width), which may exceed the tokenizer's.
        stop_token_ids: the tokens that end a request: a grammar allows them once its language is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar

        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgrammar.GrammarCompiler(info)
        self._compiled = functools.lru_cache(maxsize=256)(lambda output: self._compiler.compile_grammar(grammar(output)))
        self._lock = threading.Lock()  # requests with one new spec arriving together compile it once

    def constraint(self, output: StructuredOutput) -> Constraint:
        import xgrammar

        with self._lock:
            compiled = self._compiled(output)
        return Constraint(xgrammar.GrammarMatcher(compiled))


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        self._matcher.accept_token(token_id)

    @property
    def complete(self) -> bool:
        """The grammar accepted a stop token: its language is complete and nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


@dataclass
class MaskTimer:
    """The seconds spent masking: per constrained row, averaged over recent steps (the step-time model's
    term for them), and in the step under way (which the engine takes out of the step's time)."""

    seconds_per_row: float = 0.0
    step_seconds: float = 0.0
    weight: float = 0.1

    def add(self, seconds: float, rows: int) -> None:
        per_row = seconds / rows
        self.seconds_per_row = per_row if not self.seconds_per_row else \
            (1 - self.weight) * self.seconds_per_row + self.weight * per_row
        self.step_seconds += seconds

    def take_step_seconds(self) -> float:
        seconds, self.step_seconds = self.step_seconds, 0.0
        return seconds


def apply(logits: torch.Tensor, constraints: dict[int, Constraint], timer: MaskTimer | None = None) -> None:
    """Mask, in place, every token that the constraint of each row in ``constraints`` does not allow next."""
    import xgrammar

    started = time.perf_counter()
    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, constraint in constraints.items():
        constraint.fill(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=sorted(constraints))
    if timer is not None:
        timer.add(time.perf_counter() - started, len(constraints))
