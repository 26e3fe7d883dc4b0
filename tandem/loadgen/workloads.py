"""Workloads as explicit request lists, so the live benchmark and the simulator replay the same thing.

Token ids are drawn from a seeded generator: a workload is fully determined by its parameters.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_TOKEN_ID = 10  # keeps clear of the special tokens at the bottom of most vocabularies


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    ``output_tokens`` is how many tokens the request really produces (its natural end); it is at most
    ``max_new_tokens``, the budget the router and the worker see.
    """

    req_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and the prefixes warmed on every worker before the first arrival."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    warm_prefixes: tuple[tuple[int, ...], ...] = ()
    parameters: tuple[tuple[str, object], ...] = ()

    def describe(self) -> dict:
        return {"name": self.name, "num_requests": len(self.requests), **dict(self.parameters)}


def _tokens(rng: random.Random, count: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count))


def seed_burst(num_requests: int, vocab_size: int, *, seed: int = 0, interval_s: float = 0.05,
               prompt_tokens: int = 516, prefix_tokens: int = 496, max_new_tokens: int = 128,
               output_fraction: float = 1.0) -> Workload:
    """The article's experiment: one request every ``interval_s``, each ``prompt_tokens`` long, the first
    ``prefix_tokens`` a prefix shared by all and warmed on every worker, and the rest unique.

    ``output_fraction`` below 1 draws each request's real output length uniformly from
    [1, output_fraction * 2 * max_new_tokens] capped at the budget, so its mean is about that fraction.
    """
    _check(num_requests=num_requests, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens)
    if not 0 <= prefix_tokens < prompt_tokens:
        raise ValueError(f"prefix_tokens must be in [0, prompt_tokens), got {prefix_tokens}")
    if not 0 < output_fraction <= 1:
        raise ValueError(f"output_fraction must be in (0, 1], got {output_fraction}")
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_tokens, vocab_size)
    requests = []
    for index in range(num_requests):
        output = max_new_tokens
        if output_fraction < 1:
            output = min(max_new_tokens, rng.randint(1, max(1, round(2 * output_fraction * max_new_tokens))))
        requests.append(WorkloadRequest(f"burst-{index:05d}", index * interval_s,
                                        prefix + _tokens(rng, prompt_tokens - prefix_tokens, vocab_size),
                                        max_new_tokens, output))
    parameters = (("interval_s", interval_s), ("prompt_tokens", prompt_tokens), ("prefix_tokens", prefix_tokens),
                  ("max_new_tokens", max_new_tokens), ("output_fraction", output_fraction), ("seed", seed))
    return Workload("seed-burst", tuple(requests), (prefix,) if prefix_tokens else (), parameters)


def poisson(num_requests: int, vocab_size: int, *, seed: int = 0, rate_per_s: float = 1.0,
            prompt_tokens_mean: int = 400, output_tokens_mean: int = 64, max_new_tokens: int = 256,
            prefix_share: float = 0.5, num_prefixes: int = 4, prefix_tokens: int = 256) -> Workload:
    """Poisson arrivals at ``rate_per_s``.

    Prompt lengths are log-normal around ``prompt_tokens_mean``; real output lengths are geometric with
    mean ``output_tokens_mean``, capped at ``max_new_tokens`` (the budget, usually much larger). A
    fraction ``prefix_share`` of requests starts with one of ``num_prefixes`` shared prefixes of
    ``prefix_tokens`` tokens, warmed on every worker.
    """
    _check(num_requests=num_requests, prompt_tokens_mean=prompt_tokens_mean, max_new_tokens=max_new_tokens,
           output_tokens_mean=output_tokens_mean, num_prefixes=num_prefixes)
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise ValueError(f"rate_per_s must be a positive number, got {rate_per_s}")
    if not 0 <= prefix_share <= 1:
        raise ValueError(f"prefix_share must be in [0, 1], got {prefix_share}")
    rng = random.Random(seed)
    prefixes = [_tokens(rng, prefix_tokens, vocab_size) for _ in range(num_prefixes)] if prefix_share else []
    sigma = 0.5
    mu = math.log(prompt_tokens_mean) - sigma**2 / 2
    clock = 0.0
    requests = []
    for index in range(num_requests):
        clock += rng.expovariate(rate_per_s)
        length = max(1, round(rng.lognormvariate(mu, sigma)))
        prompt: tuple[int, ...] = ()
        if prefixes and rng.random() < prefix_share:
            prompt = rng.choice(prefixes)
        prompt += _tokens(rng, max(1, length - len(prompt)), vocab_size)
        output = min(max_new_tokens, 1 + int(rng.expovariate(1 / max(1e-9, output_tokens_mean - 1))))
        requests.append(WorkloadRequest(f"poisson-{index:05d}", clock, prompt, max_new_tokens, output))
    parameters = (("rate_per_s", rate_per_s), ("prompt_tokens_mean", prompt_tokens_mean),
                  ("output_tokens_mean", output_tokens_mean), ("max_new_tokens", max_new_tokens),
                  ("prefix_share", prefix_share), ("num_prefixes", num_prefixes), ("prefix_tokens", prefix_tokens),
                  ("seed", seed))
    return Workload("poisson", tuple(requests), tuple(prefixes), parameters)


def long_context(num_requests: int, vocab_size: int, *, context_tokens: int, seed: int = 0,
                 interval_s: float = 0.05, max_new_tokens: int = 128, warmed: bool = False,
                 new_turn_tokens: int = 20) -> Workload:
    """A burst of requests, each with its own context of ``context_tokens`` tokens: every request holds
    its whole context in KV, so KV capacity caps a worker's concurrency.

    With ``warmed``, each context is a conversation history already computed on every worker (as far
    as its cache holds it), and the prompt adds a new turn of ``new_turn_tokens``.
    """
    _check(num_requests=num_requests, context_tokens=context_tokens, max_new_tokens=max_new_tokens,
           new_turn_tokens=new_turn_tokens)
    rng = random.Random(seed)
    contexts = [_tokens(rng, context_tokens, vocab_size) for _ in range(num_requests)]
    turn = new_turn_tokens if warmed else 0
    requests = tuple(
        WorkloadRequest(f"long-{index:05d}", index * interval_s, context + _tokens(rng, turn, vocab_size),
                        max_new_tokens, max_new_tokens)
        for index, context in enumerate(contexts)
    )
    parameters = (("context_tokens", context_tokens), ("warmed", warmed), ("interval_s", interval_s),
                  ("max_new_tokens", max_new_tokens), ("seed", seed))
    return Workload("long-context", requests, tuple(contexts) if warmed else (), parameters)


WORKLOADS = {"seed-burst": seed_burst, "poisson": poisson, "long-context": long_context}


def _check(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def add_workload_arguments(parser) -> None:
    """The workload flags shared by `tandem bench` and `tandem sim`."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=sorted(WORKLOADS), default="seed-burst")
    group.add_argument("--requests", type=int, default=8, help="number of requests")
    group.add_argument("--seed", type=int, default=0, help="seed of token ids, arrivals and lengths")
    group.add_argument("--interval-s", type=float, default=0.05, help="seed-burst, long-context: gap between arrivals")
    group.add_argument("--prompt-tokens", type=int, default=516, help="seed-burst: prompt length")
    group.add_argument("--prefix-tokens", type=int, default=None,
                       help="seed-burst: shared warmed prefix (default 496); poisson: length of each shared prefix "
                            "(default 256)")
    group.add_argument("--max-new-tokens", type=int, default=None,
                       help="budget per request (default 128 for seed-burst and long-context, 256 for poisson)")
    group.add_argument("--output-fraction", type=float, default=1.0,
                       help="seed-burst: mean real output length as a fraction of the budget (1: exactly the budget)")
    group.add_argument("--rate", type=float, default=1.0, help="poisson: arrivals per second")
    group.add_argument("--prompt-tokens-mean", type=int, default=400, help="poisson: mean prompt length")
    group.add_argument("--output-tokens-mean", type=int, default=64, help="poisson: mean real output length")
    group.add_argument("--prefix-share", type=float, default=0.5, help="poisson: fraction of requests with a shared prefix")
    group.add_argument("--num-prefixes", type=int, default=4, help="poisson: number of distinct shared prefixes")
    group.add_argument("--context-tokens", type=int, default=4096, help="long-context: unique context per request")


def build_workload(args, vocab_size: int) -> Workload:
    """The workload the parsed flags describe (ValueError names the bad flag's parameter)."""
    if args.workload == "seed-burst":
        return seed_burst(args.requests, vocab_size, seed=args.seed, interval_s=args.interval_s,
                          prompt_tokens=args.prompt_tokens,
                          prefix_tokens=496 if args.prefix_tokens is None else args.prefix_tokens,
                          max_new_tokens=args.max_new_tokens or 128, output_fraction=args.output_fraction)
    if args.workload == "poisson":
        return poisson(args.requests, vocab_size, seed=args.seed, rate_per_s=args.rate,
                       prompt_tokens_mean=args.prompt_tokens_mean, output_tokens_mean=args.output_tokens_mean,
                       max_new_tokens=args.max_new_tokens or 256, prefix_share=args.prefix_share,
                       num_prefixes=args.num_prefixes,
                       prefix_tokens=256 if args.prefix_tokens is None else args.prefix_tokens)
    return long_context(args.requests, vocab_size, context_tokens=args.context_tokens, seed=args.seed,
                        interval_s=args.interval_s, max_new_tokens=args.max_new_tokens or 128)
