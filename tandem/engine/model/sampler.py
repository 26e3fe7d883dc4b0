"""Token sampling: logit processing (bias, min_tokens, penalties), then greedy or temperature, min-p, top-k
and top-p with a per-request seeded generator; log-probabilities where a request asks for them."""

from __future__ import annotations

from collections.abc import Collection

import torch

from tandem.engine.request import Request, Sample, TokenLogprobs


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int]) -> list[Sample]:
    """Pick one token per row of ``logits`` [len(requests), vocab] by each request's sampling settings."""
    raw = logits.float()
    processed = _processed(raw, requests, eos_token_ids)
    greedy = processed.argmax(dim=-1).tolist()
    samples = []
    for row, request in enumerate(requests):
        params = request.sampling
        token = greedy[row] if params.is_greedy else _draw(processed[row], request)
        logprobs = None if params.logprobs is None else token_logprobs(raw[row:row + 1], [token], params.logprobs)[0]
        samples.append(Sample(token, logprobs))
    return samples


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's token's log-probability and rank under that row of ``logits`` [len(token_ids), vocab], and
    the row's ``num_top`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    tops = [()] * len(token_ids)
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        tops = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    return [TokenLogprobs(token, logprob, rank, top)
            for token, logprob, rank, top in zip(token_ids, chosen[:, 0].tolist(), ranks, tops)]


def _processed(logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int]) -> torch.Tensor:
    """``logits`` after each request's bias, min_tokens ban and penalties; the same tensor if none has any."""
    rows = [row for row, request in enumerate(requests) if _processes_logits(request)]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for row in rows:
        request, params, scores = requests[row], requests[row].sampling, logits[row]
        if params.logit_bias:
            scores[torch.tensor(list(params.logit_bias), dtype=torch.long)] += torch.tensor(
                list(params.logit_bias.values()), dtype=scores.dtype)
        if request.num_output_tokens < params.min_tokens:
            banned = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_token_ids))
            scores[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
        if params.repetition_penalty != 1:
            seen = torch.tensor(request.token_ids, dtype=torch.long).unique()
            values = scores[seen]
            scores[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            counts = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def _processes_logits(request: Request) -> bool:
    params = request.sampling
    return bool(params.logit_bias) or params.has_penalties or request.num_output_tokens < params.min_tokens


def _draw(scores: torch.Tensor, request: Request) -> int:
    params = request.sampling
    scores = scores / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        scores = scores.index_fill(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=_generator(request, scores.device)).item())


def _generator(request: Request, device: torch.device) -> torch.Generator:
    if request.sampler_state is None:
        generator = torch.Generator(device=device)
        if request.sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.sampling.seed)
        request.sampler_state = generator
    return request.sampler_state
