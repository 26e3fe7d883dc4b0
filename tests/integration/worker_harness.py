"""Test-only launcher: a cpu_worker whose model steps are slowed or made to fail.

Fault injection lives here, in the tests, never in the product: this script wraps the real
ModelRunner.execute and then runs the real worker entry point.

Environment:
    HARNESS_STEP_DELAY_S: seconds to sleep before every model step.
    HARNESS_FAIL_AFTER_STEPS: raise RuntimeError("injected fault") on every step after this many.
    HARNESS_WATCH_STATE_WITHOUT_PREFIX_CACHE: WatchState ignores prefix_cache_changes, as a worker built
        before that field did.
"""

import os
import sys
import time

from tandem.engine.model.runner import ModelRunner


def install() -> None:
    delay = float(os.environ.get("HARNESS_STEP_DELAY_S", "0"))
    fail_after = int(os.environ.get("HARNESS_FAIL_AFTER_STEPS", "-1"))
    execute = ModelRunner.execute
    steps = {"count": 0}

    def wrapped(self, output):
        steps["count"] += 1
        if fail_after >= 0 and steps["count"] > fail_after:
            raise RuntimeError("injected fault")
        time.sleep(delay)
        return execute(self, output)

    ModelRunner.execute = wrapped
    if os.environ.get("HARNESS_WATCH_STATE_WITHOUT_PREFIX_CACHE"):
        from tandem.worker.servicer import WorkerServicer

        watch_state = WorkerServicer.WatchState

        async def without_prefix_cache(self, request, context):
            request.prefix_cache_changes = False
            async for state in watch_state(self, request, context):
                yield state

        WorkerServicer.WatchState = without_prefix_cache


if __name__ == "__main__":
    install()
    from cpu_worker.__main__ import DEFAULT_PORT, resolve_device
    from tandem.worker.server import main

    sys.exit(main("cpu", DEFAULT_PORT, resolve_device))
