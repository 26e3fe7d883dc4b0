"""One request's state as it moves through the engine."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from tandem.engine.utils import cdiv
from tandem.sampling import SamplingParams
from tandem.structured import Constraint


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    ABORTED = "aborted"
    ERROR = "error"


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every finished status sorts after RUNNING."""

    WAITING = 0
    RUNNING = 1
    FINISHED_LENGTH = 2
    FINISHED_STOP = 3
    FINISHED_EOS = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_STOP: FinishReason.STOP,
    RequestStatus.FINISHED_EOS: FinishReason.EOS,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORTED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position: of the token there, its rank (1 is the most likely), and of the
    most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Sample:
    """What one step computed for one request: the token sampled (None for a prefill chunk that samples
    none), with its log-probabilities if the request asked for them; and for a request that asked for its
    prompt's, those of the prompt tokens after positions ``prompt_start`` onwards of the chunk."""

    token_id: int | None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_start: int = 0


@dataclass(eq=False)
class Request:
    """A generation request plus everything the scheduler tracks about it.

    ``token_ids`` holds the prompt followed by the generated tokens; ``num_computed_tokens`` of them
    have their keys and values in the KV cache. ``shares_prompt_with``: another sample of the same prompt,
    which computes it first; this one waits for that, then finds the prompt's blocks in the prefix cache.
    """

    req_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    include_stop_string: bool = False
    skip_special_tokens: bool = True
    arrival_time: float = field(default_factory=time.monotonic)
    shares_prompt_with: Request | None = None

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_prefill_tokens: int = 0
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    cache_estimate_hashes: list[bytes] = field(default_factory=list)
    num_cached_estimate: int = 0
    num_published_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None
    sampler_state: object = None
    constraint: Constraint | None = None  # its structured output's state (``LLMEngine.constrain``)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for its prompt's log-probabilities and has not had them yet (no token was generated)."""
        return self.sampling.prompt_logprobs is not None and not self.num_output_tokens

    @property
    def constrained(self) -> bool:
        """It has a structured output."""
        return self.sampling.structured_output is not None

    @property
    def prompt_ready(self) -> bool:
        """Whether the request may start: it shares no prompt, or the sample it shares one with has computed
        it (or ended)."""
        first = self.shares_prompt_with
        return first is None or first.status.is_finished or first.num_computed_tokens >= first.num_prompt_tokens

    @property
    def decode_budget(self) -> int:
        """Tokens this request may still generate."""
        return self.max_new_tokens - self.num_output_tokens

    @property
    def prefill_remaining(self) -> int:
        """Tokens of the current prefill (prompt, or prompt plus outputs after preemption) not yet computed."""
        return max(0, self.num_prefill_tokens - self.num_computed_tokens)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def samples(self, n: int) -> list[Request]:
        """This request and ``n - 1`` more samples of its prompt (ids ``<id>#1``, ...), which share its
        prompt's blocks; where it has a seed, sample i is seeded ``seed + i``. Only the first computes the
        prompt's log-probabilities."""
        sampling = self.sampling
        return [self, *(Request(
            f"{self.req_id}#{index}", self.prompt_token_ids, self.max_new_tokens,
            dataclasses.replace(sampling, prompt_logprobs=None,
                                seed=None if sampling.seed is None else sampling.seed + index),
            self.ignore_eos, self.stop_token_ids, self.stop_strings, self.include_stop_string,
            self.skip_special_tokens, self.arrival_time, shares_prompt_with=self) for index in range(1, n))]

    def num_required_blocks(self, num_new_tokens: int, block_size: int) -> int:
        """Blocks that hold the computed tokens plus ``num_new_tokens`` more."""
        return cdiv(self.num_computed_tokens + num_new_tokens, block_size)

    def num_computed_full_blocks(self, block_size: int) -> int:
        """Blocks completely filled by computed tokens."""
        return self.num_computed_tokens // block_size

    def max_num_blocks(self, block_size: int) -> int:
        """Blocks the request holds at its longest: the prompt plus every token it may generate."""
        return cdiv(self.num_prompt_tokens + self.max_new_tokens, block_size)

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        """The tokens of block ``index``."""
        return self.token_ids[index * block_size:(index + 1) * block_size]
