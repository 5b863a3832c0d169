"""The cost model: lines learnt from timings, predictions, and the dispatch choice."""

from __future__ import annotations

import threading

import pytest

from pdclient._errors import PDConfigError
from pdclient.costs import (
    CONCURRENT,
    PROBE_EVERY,
    SEQUENTIAL,
    SEQUENTIAL_FOR_S,
    CallCost,
    CostLine,
    CostModel,
    CostPriors,
    DispatchReason,
    Line,
)

D1, P1 = "http://d1/v1", "http://p1/v1"


def test_a_line_takes_the_prior_slope_until_it_has_enough_samples() -> None:
    line = CostLine(Line(10.0, 1.0), min_samples=4)
    assert line.line() == Line(10.0, 1.0)
    for tokens in (100, 200, 300):
        line.add(tokens, 50 + 2 * tokens)
    assert line.line() == Line(250.0, 1.0, 3)  # the step the samples leave over at the prior's slope
    line.add(400, 850)
    assert line.line() == Line(50.0, 2.0, 4)


def test_a_line_shrugs_off_an_outlier() -> None:
    """One call queued behind a long prompt moves neither the slope nor the step."""
    line = CostLine(Line(10.0, 1.0))
    for i in range(12):
        tokens = 50 + 25 * i
        line.add(tokens, 20 + 1.5 * tokens)
    line.add(100, 5_000.0)
    fitted = line.line()
    assert fitted.ms_per_token == pytest.approx(1.5)
    assert fitted.fixed_ms == pytest.approx(20.0)


def test_a_line_of_alike_counts_keeps_the_prior_slope_and_learns_the_step() -> None:
    line = CostLine(Line(10.0, 1.0))
    for ms in (400.0, 410.0, 390.0, 405.0, 395.0):
        line.add(300, ms)
    assert line.line() == Line(100.0, 1.0, 5)


def test_a_line_faster_than_its_prior_slope_allows_takes_its_own_rate() -> None:
    """A GPU's decode-only calls: a few ms for hundreds of tokens, where the prior says 1 ms a token."""
    line = CostLine(Line(10.0, 1.0))
    line.add(300, 6.0)
    assert line.line() == Line(0.0, 0.02, 1)


def test_decode_only_is_probed_every_other_call_until_timed_then_rarely() -> None:
    model = CostModel()
    assert [model.probe_due(D1) for _ in range(6)] == [True, False] * 3
    for tokens in (100, 200, 300, 400):
        model.decode_only(D1, tokens, 5.0)
    later = [model.probe_due(D1) for _ in range(3 * PROBE_EVERY)]
    assert later.count(True) == 3


def test_a_line_keeps_a_bounded_window() -> None:
    line = CostLine(Line(10.0, 1.0), window=8)
    for i in range(100):
        line.add(10 * i, 5.0 + i)
    assert len(line) == 8


def test_a_line_ignores_what_is_no_measurement() -> None:
    line = CostLine(Line(10.0, 1.0), min_samples=1)
    line.add(-1, 10.0)
    line.add(10, float("nan"))
    line.add(10, -5.0)
    assert len(line) == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True])
def test_a_line_refuses_a_bad_number(bad: float) -> None:
    with pytest.raises(PDConfigError, match="fixed_ms"):
        Line(bad, 1.0)


def test_the_priors_meet_where_the_fixed_rule_did() -> None:
    """No traffic yet: a turn of 255 uncached tokens is faster decode-only, 256 is not."""
    model = CostModel()
    below, at = model.predict(D1, 255, streams=0), model.predict(D1, 256, streams=0)
    assert below.decode_only_ms < below.handoff_ms
    assert at.decode_only_ms >= at.handoff_ms
    assert (below.stall_ms, below.streams) == (0.0, 0)


def test_the_stall_is_the_decode_only_time_to_first_token_when_streams_run() -> None:
    model = CostModel()
    for tokens in (100, 200, 300, 400, 500):
        model.decode_only(D1, tokens, 30 + 2.0 * tokens)
    costs = model.predict(D1, 300, streams=3)
    assert costs.decode_only_ms == pytest.approx(630.0)
    # The running streams wait for the turn's first token, its step and request included.
    assert costs.stall_ms == pytest.approx(630.0)
    assert costs.compute_ms == pytest.approx(600.0)  # what bounds a trial
    assert model.predict(D1, 300, streams=0).stall_ms == 0.0
    # What earlier turns charged the running streams (``pools.StallLedger``) rides along.
    assert model.predict(D1, 300, streams=3, charged_ms=120.0).charged_ms == 120.0
    assert model.predict(D1, 300, streams=0, charged_ms=120.0).charged_ms == 0.0
    assert model.predict(D1, 300, streams=3, charged_ms=float("nan")).charged_ms == 0.0
    assert model.decode_prefill(D1) == Line(30.0, 2.0, 5)
    assert model.decode_prefill("http://d2/v1") == CostPriors().decode_prefill


def test_the_streams_answer_time_is_learnt_per_decode_endpoint_from_whole_answers() -> None:
    model = CostModel()
    assert model.predict(D1, 300, streams=1).answer_ms == CostPriors().answer_ms == 1500.0
    for answer_ms in (4000.0, 5000.0, 90_000.0):  # one answer held up for a minute moves nothing
        model.learn(CallCost(500.0, D1, 300, prefill_url=P1, dispatch=SEQUENTIAL, answer_ms=answer_ms))
    assert model.answer_ms(D1) == 1500.0  # too few answers yet: the prior's
    model.learn(CallCost(200.0, D1, 100, answer_ms=4500.0))  # a decode-only call's answer counts alike
    model.answer(D1, -1.0)  # a clock that went back: no measurement
    model.answer(D1, float("nan"))
    assert model.answer_ms(D1) == model.predict(D1, 300, streams=1).answer_ms == 4750.0
    assert model.answer_ms("http://d2/v1") == 1500.0  # another endpoint's streams are its own
    assert ("answer", D1, Line(4750.0, 0.0, 4)) in model.lines()
    assert ("answer", "http://d2/v1", Line(1500.0, 0.0, 0)) in model.lines()
    for _ in range(CostPriors().window):
        model.answer(D1, 6000.0)
    assert model.answer_ms(D1) == 6000.0  # a bounded window of the most recent


def test_the_handover_is_learnt_from_handoffs() -> None:
    model = CostModel()
    for tokens in (100, 200, 300, 400):
        model.handoff(P1, SEQUENTIAL, tokens, 600 + 0.5 * tokens)
    assert model.handover() == Line(600.0, 0.5, 4)
    assert model.handover(P1, SEQUENTIAL) == Line(600.0, 0.5, 4)
    assert model.handover(P1, CONCURRENT) == CostPriors().handoff
    assert model.predict(D1, 300, streams=0).handoff_ms == pytest.approx(750.0)


def test_a_finished_call_teaches_the_line_of_the_route_it_took() -> None:
    model, lines = CostModel(), CostModel()
    for tokens in (100, 200, 300, 400, 500):
        model.learn(CallCost(30 + 2.0 * tokens, D1, tokens))  # no prefill endpoint: decode-only
        model.learn(CallCost(600 + 0.5 * tokens, D1, tokens, prefill_url=P1, dispatch=SEQUENTIAL))
        lines.decode_only(D1, tokens, 30 + 2.0 * tokens)
        lines.handoff(P1, SEQUENTIAL, tokens, 600 + 0.5 * tokens)
    assert model.decode_prefill(D1) == lines.decode_prefill(D1) == Line(30.0, 2.0, 5)
    assert model.handover(P1, SEQUENTIAL) == lines.handover(P1, SEQUENTIAL)


def test_two_models_fed_the_same_traffic_predict_alike() -> None:
    a, b = CostModel(), CostModel()
    for model in (a, b):
        for i in range(40):
            model.decode_only(D1, 50 + (i * 37) % 300, 20 + (i * 53) % 400)
            model.handoff(P1, SEQUENTIAL, 50 + (i * 41) % 300, 300 + (i * 29) % 200)
    assert a.predict(D1, 200, 2) == b.predict(D1, 200, 2)


def test_the_model_is_thread_safe() -> None:
    model = CostModel()

    def feed() -> None:
        for i in range(500):
            model.decode_only(D1, i % 300, float(i))
            model.predict(D1, 100, 1)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert model.decode_prefill(D1).samples == CostPriors().window


# -- dispatch -------------------------------------------------------------------------


def settle(model: CostModel, sequential_ms: float, concurrent_ms: float, calls: int = 40) -> list[str]:
    modes = []
    for i in range(calls):
        choice = model.choose_dispatch(P1, 300, now=float(i))
        modes.append(choice.mode)
        model.handoff(P1, choice.mode, 300, sequential_ms if choice.mode == SEQUENTIAL else concurrent_ms)
    return modes


def test_dispatch_tries_both_modes_then_settles_on_the_faster() -> None:
    model = CostModel()
    modes = settle(model, sequential_ms=190.0, concurrent_ms=150.0)
    assert modes[:8].count(CONCURRENT) == 4 and modes[:8].count(SEQUENTIAL) == 4
    settled = modes[8:]
    assert settled.count(CONCURRENT) >= len(settled) - 3
    choice = model.choose_dispatch(P1, 300, now=100.0)
    assert choice.sequential_ms == pytest.approx(190.0) and choice.concurrent_ms == pytest.approx(150.0)


def test_dispatch_stays_sequential_where_concurrency_does_not_pay() -> None:
    model = CostModel()
    modes = settle(model, sequential_ms=400.0, concurrent_ms=600.0)
    settled = modes[8:]
    assert settled.count(SEQUENTIAL) >= len(settled) - 3


def test_dispatch_wants_a_margin_before_it_goes_concurrent() -> None:
    model = CostModel()
    modes = settle(model, sequential_ms=400.0, concurrent_ms=390.0)
    assert modes[8:].count(SEQUENTIAL) >= len(modes[8:]) - 3


def test_dispatch_probes_the_other_mode_once_every_so_often_and_deterministically() -> None:
    a, b = CostModel(), CostModel()
    modes_a = settle(a, 190.0, 150.0, calls=8 + 2 * PROBE_EVERY)
    modes_b = settle(b, 190.0, 150.0, calls=8 + 2 * PROBE_EVERY)
    assert modes_a == modes_b
    assert modes_a[8:].count(SEQUENTIAL) == 2


def test_dispatch_goes_sequential_for_a_while_after_two_coordinate_changes() -> None:
    model = CostModel()
    settle(model, 190.0, 150.0, calls=12)
    model.coordinates(P1, "engine-a", now=1000.0)
    model.coordinates(P1, "engine-b", now=1010.0)
    assert model.choose_dispatch(P1, 300, now=1020.0).reason is not DispatchReason.COORDINATES_UNSTABLE
    model.coordinates(P1, "engine-c", now=1200.0)  # a second change within 5 min
    choice = model.choose_dispatch(P1, 300, now=1201.0)
    assert (choice.mode, choice.reason) == (SEQUENTIAL, DispatchReason.COORDINATES_UNSTABLE)
    assert model.choose_dispatch(P1, 300, now=1200.0 + SEQUENTIAL_FOR_S - 1).mode == SEQUENTIAL
    assert model.choose_dispatch(P1, 300, now=1200.0 + SEQUENTIAL_FOR_S + 1).reason in (
        DispatchReason.CONCURRENT_FASTER,
        DispatchReason.PROBE,
    )


def test_changes_far_apart_do_not_make_dispatch_sequential() -> None:
    model = CostModel()
    model.coordinates(P1, "engine-a", now=0.0)
    model.coordinates(P1, "engine-b", now=10.0)
    model.coordinates(P1, "engine-c", now=400.0)
    model.coordinates(P1, "engine-c", now=401.0)
    assert model.choose_dispatch(P1, 300, now=402.0).reason is DispatchReason.LEARNING
