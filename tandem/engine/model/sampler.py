"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import torch

from tandem.engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Pick one token per row of ``logits`` [len(requests), vocab] by each request's sampling settings."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    tokens = []
    for row, request in enumerate(requests):
        params = request.sampling
        if params.is_greedy:
            tokens.append(greedy[row])
            continue
        scores = logits[row] / params.temperature
        if 0 < params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
            scores = scores.index_fill(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=_generator(request, logits.device)).item()))
    return tokens


def _generator(request: Request, device: torch.device) -> torch.Generator:
    if request.sampler_state is None:
        generator = torch.Generator(device=device)
        if request.sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.sampling.seed)
        request.sampler_state = generator
    return request.sampler_state
