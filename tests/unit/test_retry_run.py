"""``pools.retry.retrying``: tenacity's loop from the first attempt's failure, counted as
tenacity counts, its waits ``Sleep`` steps that a sync or an async driver runs."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
import tenacity

from pdclient.pools import retry

POLICY = {
    "stop": tenacity.stop_after_attempt(3),
    "wait": tenacity.wait_fixed(0.01),
    "retry": tenacity.retry_if_exception_type(httpx.ConnectError),
    "reraise": True,
}


class Flaky:
    """Fails with ``error`` the first ``failures`` times, then answers its attempt number."""

    def __init__(self, failures: int, error: BaseException | None = None) -> None:
        self.failures = failures
        self.error = error or httpx.ConnectError("refused")
        self.attempts = 0

    def __call__(self, tag: str) -> str:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise self.error
        return f"{tag}-{self.attempts}"

    async def async_call(self, tag: str) -> str:
        await anyio.lowlevel.checkpoint()
        return self(tag)


def attempt(flaky: Flaky) -> Generator[Any, Any, str]:
    answer: str = yield flaky
    return answer


async def run(mode: str, flaky: Flaky, policy: dict[str, object] = POLICY) -> str:
    """Drive ``retrying`` as the transports' drivers do: ``flaky`` answered in place, a ``Sleep`` slept."""
    steps = retry.retrying(policy, lambda: attempt(flaky))
    result: Any = None
    failure: BaseException | None = None
    while True:
        try:
            step = steps.send(result) if failure is None else steps.throw(failure)
        except StopIteration as done:
            return str(done.value)
        result, failure = None, None
        try:
            if isinstance(step, retry.Sleep):
                await anyio.sleep(step.seconds)  # the async driver's; the sync one's is time.sleep
            else:
                result = await flaky.async_call("a") if mode == "async" else flaky("a")
        except BaseException as exc:
            failure = exc


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_first_attempt_that_answers_ends_it(mode: str) -> None:
    for failures in (0, 1, 2):
        flaky = Flaky(failures)
        assert await run(mode, flaky) == f"a-{failures + 1}" and flaky.attempts == failures + 1


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_bare_first_attempt_counts_against_the_stop(mode: str) -> None:
    flaky = Flaky(5)
    with pytest.raises(httpx.ConnectError):
        await run(mode, flaky)
    assert flaky.attempts == 3


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_an_error_the_policy_does_not_retry_is_raised_at_once(mode: str) -> None:
    flaky = Flaky(1, httpx.ReadTimeout("slow"))
    with pytest.raises(httpx.ReadTimeout):
        await run(mode, flaky)
    assert flaky.attempts == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_waits_see_the_attempt_numbers_tenacity_gives(mode: str) -> None:
    seen: list[int] = []

    def wait(state: tenacity.RetryCallState) -> float:
        seen.append(state.attempt_number)
        return 0.0

    flaky = Flaky(2)
    assert await run(mode, flaky, {**POLICY, "wait": wait}) == "a-3"
    assert seen == [1, 2]  # as tenacity.Retrying(...)(fn): the wait after attempt 1, then after 2
