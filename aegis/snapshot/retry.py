"""Retry policy for the durable tier: tenacity, as a policy object.

Exponential backoff with full jitter, bounded attempts and total time, a predicate for what is
worth retrying, and an injectable ``sleep`` so tests never sleep. The final error carries the
last attempt's exception; ``on_retry`` sees every retried failure (for event counters).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import tenacity

__all__ = ["RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 10
    max_total_s: float = 300.0
    initial_s: float = 0.05
    max_backoff_s: float = 5.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)

    def call(
        self,
        fn: Callable[[], T],
        *,
        retryable: Callable[[BaseException], bool],
        on_retry: Callable[[BaseException], None] | None = None,
    ) -> T:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            if on_retry is not None and state.outcome is not None:
                exc = state.outcome.exception()
                if exc is not None:
                    on_retry(exc)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts)
            | tenacity.stop_after_delay(self.max_total_s),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_s, max=self.max_backoff_s),
            retry=tenacity.retry_if_exception(retryable),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn)
