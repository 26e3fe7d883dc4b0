"""How far a weight format moves a model's next-token distributions from float32's, measured the way
llama.cpp's ``perplexity --kl-divergence`` measures quantization: teacher-forced, at every position of a
text under the same context, against the reference's distribution at that position.

Free-running continuations are not the measure: one near-tie that flips early sends a greedy continuation
down another path for good, however close the distributions stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class Quality:
    """A candidate's log-probabilities against the reference's, at the same positions.

    ``perplexity_ratio``: the candidate's perplexity of the text over the reference's; ``mean_kl``: the mean
    KL divergence (nats) of the candidate's next-token distribution from the reference's; ``top1_agreement``:
    the share of positions where both rank the same token first.
    """

    positions: int
    reference_perplexity: float
    perplexity: float
    mean_kl: float
    top1_agreement: float

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity

    @classmethod
    def of(cls, reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor) -> "Quality":
        """``reference``, ``candidate``: log-probabilities [positions, vocab]; ``targets``: the text's next
        token at each position."""
        reference, candidate = reference.double(), candidate.double()
        rows = torch.arange(len(targets))
        kl = (reference.exp() * (reference - candidate)).sum(dim=1)
        return cls(len(targets), math.exp(-reference[rows, targets].mean().item()),
                   math.exp(-candidate[rows, targets].mean().item()), kl.mean().item(),
                   (reference.argmax(dim=1) == candidate.argmax(dim=1)).double().mean().item())

    def passes(self, max_perplexity_change: float = 0.01, max_mean_kl: float = 0.01,
               min_top1_agreement: float = 0.95) -> bool:
        """The gate a decode-weight format passes to be the default."""
        return abs(self.perplexity_ratio - 1) <= max_perplexity_change and self.mean_kl <= max_mean_kl \
            and self.top1_agreement >= min_top1_agreement

    def summary(self) -> str:
        return (f"perplexity {self.perplexity:.4f} ({100 * (self.perplexity_ratio - 1):+.2f}%), mean KL "
                f"{self.mean_kl:.5f} nats, top-1 agreement {self.top1_agreement:.1%} over {self.positions} positions")


@torch.inference_mode()
def teacher_forced_logprobs(runner, tokens: list[int], rows_per_step: int = 1) -> torch.Tensor:
    """Log-probabilities [len(tokens) - 1, vocab] of the token after each position of ``tokens``, computed
    ``rows_per_step`` positions a step over the cached context before them: one, the shape of a single stream's
    decode steps; more, that of prefill chunks. A CPU model runs the very kernels its steps of that shape run.

    ``runner``: a ``ModelRunner`` with at least ``len(tokens)`` KV slots, whose cache it overwrites.
    """
    rows = []
    for start in range(0, len(tokens) - 1, rows_per_step):
        count = min(rows_per_step, len(tokens) - 1 - start)
        rows.append(torch.log_softmax(runner.teacher_forced_logits(tokens, start, count).float(), dim=-1))
    return torch.cat(rows)
