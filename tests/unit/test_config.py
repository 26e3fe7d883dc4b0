"""Unit tests for the engine's configuration dataclasses."""

from __future__ import annotations

import pytest

from tandem.engine.config import CacheConfig, SchedulerConfig

SCHEDULER_FIELDS = ["max_active_requests", "max_waiting_requests", "max_num_batched_tokens", "block_size"]


@pytest.mark.parametrize("field", SCHEDULER_FIELDS)
@pytest.mark.parametrize("value", [0, -3, True, 2.0])
def test_scheduler_config_rejects_non_positive_integers(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_scheduler_config_requires_budget_for_one_decode_per_request():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_active_requests=8, max_num_batched_tokens=7)
    config = SchedulerConfig(max_active_requests=8, max_num_batched_tokens=8)
    assert config.max_num_batched_tokens == 8


def test_scheduler_config_is_frozen():
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.block_size = 32


@pytest.mark.parametrize(("field", "value"), [("num_kv_blocks", 0), ("num_kv_blocks", -1), ("kv_cache_bytes", 0)])
def test_cache_config_rejects_non_positive_values(field, value):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})


def test_cache_config_accepts_unset_block_count():
    assert CacheConfig().num_kv_blocks is None
    assert CacheConfig(num_kv_blocks=3).num_kv_blocks == 3
