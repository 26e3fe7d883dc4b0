"""Token sampling: logit processing (bias, min_tokens, penalties, the structured-output mask), then greedy or
temperature, min-p, top-k and top-p with a per-request seeded generator; log-probabilities where a request
asks for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch

from tandem import structured
from tandem.engine.request import Request, Sample, TokenLogprobs


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int],
           mask_timer: structured.MaskTimer | None = None) -> list[Sample]:
    """Pick one token per row of ``logits`` [len(requests), vocab] by each request's sampling settings; a
    request with a constraint (structured output) then advances it by its token."""
    raw = logits.float()
    processed = _processed(raw, requests, eos_token_ids)
    constraints = {row: request.constraint for row, request in enumerate(requests) if request.constraint is not None}
    if constraints:
        structured.apply(processed, constraints, mask_timer)
    greedy = _first_maxima(processed)
    tokens = [greedy[row] if request.sampling.is_greedy else _draw(processed[row], request)
              for row, request in enumerate(requests)]
    for row, constraint in constraints.items():
        constraint.accept(tokens[row])
    logprobs: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [row for row, request in enumerate(requests) if request.sampling.logprobs is not None]
    if rows:
        num_top = max(requests[row].sampling.logprobs for row in rows)
        computed = token_logprobs(raw[rows], [tokens[row] for row in rows], num_top)
        for row, position in zip(rows, computed):
            wanted = requests[row].sampling.logprobs
            logprobs[row] = position if wanted == num_top else dataclasses.replace(position, top=position.top[:wanted])
    return [Sample(token, position) for token, position in zip(tokens, logprobs)]


def _first_maxima(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum, as argmax picks it: through numpy on the CPU, where torch's reduction took over
    100 µs for one row of a 49k vocabulary (numpy: about 10), a step's largest cost after the model."""
    if logits.is_cpu:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.max(dim=-1).indices.tolist()


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
    device = logits.device
    for row in rows:
        request, params, scores = requests[row], requests[row].sampling, logits[row]
        if params.allowed_token_ids:
            allowed = torch.tensor(sorted(params.allowed_token_ids), dtype=torch.long, device=device)
            kept = scores[allowed]
            scores.fill_(float("-inf"))
            scores[allowed] = kept
        if params.logit_bias:
            scores[torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)] += torch.tensor(
                list(params.logit_bias.values()), dtype=scores.dtype, device=device)
        if request.num_output_tokens < params.min_tokens:
            banned = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_token_ids))
            scores[torch.tensor(sorted(banned), dtype=torch.long, device=device)] = float("-inf")
    penalised = [row for row in rows if requests[row].sampling.has_penalties]
    if penalised:
        logits[penalised] = _penalised(logits[penalised], [requests[row] for row in penalised])
    return logits


def _penalised(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The repetition, frequency and presence penalties of ``requests`` on their rows of ``logits``, at once.
    Only the logits of tokens a request has seen are touched; a padding column takes the short rows' padding."""
    vocab = logits.shape[-1]
    extended = torch.cat((logits, logits.new_zeros(len(requests), 1)), dim=1)
    repetition = _column(requests, "repetition_penalty", logits)
    if bool((repetition != 1).any()):
        seen = _padded([list(set(r.token_ids)) for r in requests], vocab, logits.device)
        values = extended.gather(1, seen)
        extended.scatter_(1, seen, torch.where(values > 0, values / repetition, values * repetition))
    frequency = _column(requests, "frequency_penalty", logits)
    if bool((frequency != 0).any()):
        generated = _padded([r.output_token_ids for r in requests], vocab, logits.device)
        extended.scatter_add_(1, generated, (-frequency).expand(generated.shape))
    presence = _column(requests, "presence_penalty", logits)
    if bool((presence != 0).any()):
        generated = _padded([list(set(r.output_token_ids)) for r in requests], vocab, logits.device)
        extended.scatter_add_(1, generated, (-presence).expand(generated.shape))
    return extended[:, :vocab]


def _column(requests: list[Request], setting: str, like: torch.Tensor) -> torch.Tensor:
    """Each request's sampling ``setting``, as a column of ``like``'s dtype on its device."""
    return torch.tensor([getattr(r.sampling, setting) for r in requests], dtype=like.dtype, device=like.device)[:, None]


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """``rows`` of token ids as one tensor on ``device``, the short ones padded with ``pad``."""
    padded = torch.full((len(rows), max(1, max(map(len, rows)))), pad, dtype=torch.long)
    for index, ids in enumerate(rows):
        padded[index, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return padded.to(device)


def _processes_logits(request: Request) -> bool:
    params = request.sampling
    return bool(params.logit_bias or params.allowed_token_ids) or params.has_penalties \
        or request.num_output_tokens < params.min_tokens or request.constraint is not None


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
