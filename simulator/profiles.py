"""Step-time models and worker profiles for the simulator.

A step's time is linear in its work, as in Vidur and BLIS and as the workers fit it themselves
(``tandem.engine.rates``): ``base + per_prefill_token * prefill_tokens + per_decode * decoding_requests``.

A profile that quotes only a prefill rate and a decode rate (as the article did) becomes a step model
through two conventions, the same ones the workers use when they quote rates:

- the decode rate is the aggregate rate of a full batch of ``reference_decode_batch`` requests, so a
  step of that batch takes ``batch / decode_rate``; ``fixed_share`` of that time is the fixed cost of a
  step (reading the weights once), the rest grows with each decoding request;
- the prefill rate is quoted for a full chunk of ``reference_prefill_tokens`` tokens, so that chunk
  takes ``chunk / prefill_rate``, the fixed cost included.

A worker that fits these coefficients from such steps reports exactly the profile's rates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tandem.engine.config import SchedulerConfig
from tandem.engine.rates import Rates, RateTracker, StepSample
from tandem.step_time import step_seconds


@dataclass(frozen=True)
class StepTimeModel:
    """A simulated worker's step times, in the terms of the model a worker reports (``tandem.step_time``)."""

    step_base_s: float
    step_per_prefill_token_s: float
    step_per_decode_s: float
    small_step_rows: int = 0
    small_step_base_s: float = 0.0
    small_step_per_row_s: float = 0.0

    def seconds(self, prefill_tokens: int, decodes: int) -> float:
        return step_seconds(self, prefill_tokens, decodes)

    @classmethod
    def from_rates(cls, prefill_tok_s: float, decode_tok_s: float, reference_prefill_tokens: int,
                   reference_decode_batch: int, fixed_share: float) -> "StepTimeModel":
        if not (prefill_tok_s > 0 and decode_tok_s > 0):
            raise ValueError("rates must be positive")
        if not 0 <= fixed_share < 1:
            raise ValueError(f"fixed_share must be in [0, 1), got {fixed_share}")
        decode_step = reference_decode_batch / decode_tok_s
        base = fixed_share * decode_step
        prefill_step = reference_prefill_tokens / prefill_tok_s
        if prefill_step <= base:
            raise ValueError("a full prefill chunk must take longer than the fixed cost of a step")
        return cls(base, (prefill_step - base) / reference_prefill_tokens,
                   (1 - fixed_share) * decode_step / reference_decode_batch)

    def fitted_rates(self, config: SchedulerConfig) -> Rates:
        """The rates a worker with this step model and ``config`` reports: the engine's rate fit over
        the calibration steps the engine measures (``RateTracker.calibration_steps``)."""
        tracker = RateTracker(config.max_num_batched_tokens, config.max_active_requests,
                              small_step_rows=self.small_step_rows)
        for prefill_tokens, decodes in tracker.calibration_steps():
            tracker.add_calibration(StepSample(prefill_tokens, decodes, self.seconds(prefill_tokens, decodes)))
        return tracker.rates()


@dataclass(frozen=True)
class WorkerProfile:
    """One simulated worker: its kind, step model, scheduler limits and KV capacity in blocks."""

    kind: str
    step: StepTimeModel
    scheduler: SchedulerConfig
    num_kv_blocks: int

    def with_max_active(self, max_active_requests: int) -> "WorkerProfile":
        chunk = max(self.scheduler.max_num_batched_tokens, max_active_requests)
        return replace(self, scheduler=replace(self.scheduler, max_active_requests=max_active_requests,
                                               max_num_batched_tokens=chunk))


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    cpu: WorkerProfile
    gpu: WorkerProfile

    def workers(self, cpu_workers: int = 1, gpu_workers: int = 1,
                gpu_max_active: int | None = None) -> dict[str, WorkerProfile]:
        """Named workers (``gpu-0``, ``cpu-0``, ...); GPUs first."""
        gpu = self.gpu if gpu_max_active is None else self.gpu.with_max_active(gpu_max_active)
        named = {f"gpu-{i}": gpu for i in range(gpu_workers)}
        named.update({f"cpu-{i}": self.cpu for i in range(cpu_workers)})
        return named


KV_BYTES_PER_TOKEN_QWEN25_05B = 24 * 2 * 2 * 64 * 2  # layers * (K, V) * KV heads * head dim * fp16 bytes
SEED_M2_FIXED_SHARE = 0.21
SEED_M2_GPU_KV_BYTES = 1 << 30
SEED_M2_CPU_KV_BYTES = 4 << 30


def _seed_m2_worker(kind: str, prefill_tok_s: float, decode_tok_s: float, kv_bytes: int,
                    fixed_share: float) -> WorkerProfile:
    # a prompt alone in chunks of 512 too: the rates are a 512-token chunk's, measured on the article's engine
    config = SchedulerConfig(max_active_requests=4, max_num_batched_tokens=512, max_prefill_step_tokens=512,
                             block_size=16)
    step = StepTimeModel.from_rates(prefill_tok_s, decode_tok_s, config.max_num_batched_tokens,
                                    config.max_active_requests, fixed_share)
    num_blocks = kv_bytes // (KV_BYTES_PER_TOKEN_QWEN25_05B * config.block_size)
    return WorkerProfile(kind, step, config, num_blocks)


def seed_m2(fixed_share: float = SEED_M2_FIXED_SHARE, gpu_kv_bytes: int = SEED_M2_GPU_KV_BYTES) -> Profile:
    """The article's Apple M2 with Qwen2.5-0.5B: CPU prefill 73 and decode 45 tok/s, GPU (Metal) prefill
    2551 and decode 293 tok/s, 4 active requests per worker.

    ``fixed_share`` 0.21 comes from the article's own makespans at 8 requests: GPU-only (two batches of 4)
    took 11.47 s and hybrid (4 then 3 on the GPU) 10.35 s, so a decode step costs about 9.4 ms plus
    8.7 ms per request there, a fixed share of 0.21 at batch 4. KV capacity: 12 KiB per token
    (fp16), 1 GiB on the GPU and 4 GiB on the CPU unless stated otherwise.
    """
    return Profile(
        "seed-m2",
        "Apple M2, Qwen2.5-0.5B (the article's measured rates)",
        cpu=_seed_m2_worker("cpu", 73.0, 45.0, SEED_M2_CPU_KV_BYTES, fixed_share),
        gpu=_seed_m2_worker("gpu", 2551.0, 293.0, gpu_kv_bytes, fixed_share),
    )


PROFILES = {"seed-m2": seed_m2}


def worker_profile_from_info(kind: str, info) -> WorkerProfile:
    """A live worker's profile from its ``GetInfoResponse``: the step model it fitted to its own
    calibration, its scheduler limits and its KV blocks."""
    rates = info.rates
    step = StepTimeModel(rates.step_base_s, rates.step_per_prefill_token_s, rates.step_per_decode_s,
                         rates.small_step_rows, rates.small_step_base_s, rates.small_step_per_row_s)
    config = SchedulerConfig(max_active_requests=info.max_active_requests,
                             max_waiting_requests=info.max_waiting_requests,
                             max_num_batched_tokens=info.max_num_batched_tokens,
                             max_prefill_step_tokens=info.max_prefill_step_tokens, block_size=info.block_size)
    return WorkerProfile(kind, step, config, info.kv_blocks_total)


def fetch_worker_profiles(specs: list[str], timeout_s: float = 10.0) -> dict[str, WorkerProfile]:
    """Profiles of running workers given as ``NAME=KIND@HOST:PORT`` (the router's worker syntax)."""
    import grpc

    from router_svc.workers import WorkerAddress
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    profiles = {}
    for spec in specs:
        address = WorkerAddress.parse(spec)
        with grpc.insecure_channel(address.address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout_s)
        profiles[address.name] = worker_profile_from_info(address.kind, info)
    return profiles
