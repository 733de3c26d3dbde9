"""Admission from predicted output lengths: the estimator, and the decisions it changes
(and those it must not change)."""

from __future__ import annotations

import random

import pytest

from cadence.statemachine.estimate import OutputLengthEstimator

from core_helpers import drive, drive_step, make_request, make_scheduler


def test_prior_is_the_declared_limit_until_enough_requests_finish():
    est = OutputLengthEstimator(window=8, min_samples=3, quantile=0.5)
    est.observe(5, at_limit=False)
    est.observe(6, at_limit=False)
    assert est.declared_only and est.predict(0, 100) == 100
    est.observe(7, at_limit=False)
    assert not est.declared_only and est.predict(0, 100) == 6


def test_requests_that_run_to_their_limit_predict_the_limit():
    """With max_tokens exact every finish is at the limit: every prediction is the
    limit, whatever the limit and the progress."""
    est = OutputLengthEstimator(window=8, min_samples=1, quantile=0.1)
    for _ in range(5):
        est.observe(40, at_limit=True)
    assert est.declared_only
    assert [est.predict(o, lim) for o, lim in [(0, 7), (3, 90), (89, 90)]] == [7, 90, 90]


def test_prediction_is_the_quantile_of_outcomes_still_possible():
    """Early stops at or below the progress are no longer possible; runs to the
    limit count as this request's own limit, after every early stop."""
    est = OutputLengthEstimator(window=10, min_samples=1, quantile=0.5)
    for n in (10, 20, 30, 40):
        est.observe(n, at_limit=False)
    est.observe(99, at_limit=True)
    # Outcomes for a fresh request with limit 200: 10, 20, 30, 40, 200 -> median 30.
    assert est.predict(0, 200) == 30
    # After 25 tokens: 30, 40, 200 -> median 40.
    assert est.predict(25, 200) == 40
    # After 40 tokens only the limit is left.
    assert est.predict(40, 200) == 200
    # A limit below the predicted length caps it.
    assert est.predict(0, 25) == 25


def test_a_request_that_outlived_every_early_stop_falls_back_to_its_limit():
    est = OutputLengthEstimator(window=4, min_samples=1, quantile=0.0)
    est.observe(3, at_limit=False)
    assert est.predict(2, 50) == 3
    assert est.predict(3, 50) == 50


def test_the_window_forgets_the_oldest_outcome():
    est = OutputLengthEstimator(window=2, min_samples=1, quantile=0.0)
    est.observe(5, at_limit=False)
    est.observe(9, at_limit=True)
    assert est.predict(0, 100) == 5
    est.observe(7, at_limit=True)  # 5 leaves the window: only runs to the limit remain
    assert est.declared_only and est.predict(0, 100) == 100


@pytest.mark.parametrize("quantile", [0.0, 0.3, 1.0])
def test_predictions_stay_between_progress_and_limit(quantile):
    rng = random.Random(3)
    est = OutputLengthEstimator(window=16, min_samples=2, quantile=quantile)
    for _ in range(200):
        est.observe(rng.randint(1, 60), at_limit=rng.random() < 0.2)
        limit = rng.randint(1, 80)
        done = rng.randint(0, limit - 1)
        assert done < est.predict(done, limit) <= limit


def workload(seed: int, n: int = 40, eos: bool = False):
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    eos_after: dict[str, int] = {}
    for i in range(n):
        rid = f"r{i}"
        out_len = rng.randint(2, 24)
        limit = out_len if not eos else 48 - 8
        arrivals.setdefault(rng.randint(0, 20), []).append(
            make_request(rid, rng.randint(4, 8), max_tokens=limit, ignore_eos=not eos))
        eos_after[rid] = out_len
    return arrivals, eos_after


@pytest.mark.parametrize("seed", range(4))
def test_exact_max_tokens_decides_as_without_prediction(seed):
    """max_tokens exact (EOS ignored): every plan is the same with prediction on or off."""
    common = dict(num_blocks=40, block_size=4, max_num_seqs=8, max_model_len=48,
                  admission_headroom_steps=16, admission_growth_share=0.95)
    on = make_scheduler(predict_output_lengths=True, length_estimate_min_samples=1, **common)
    off = make_scheduler(predict_output_lengths=False, **common)
    arrivals, eos_after = workload(seed)
    assert drive(on, arrivals, eos_after, 150) == drive(off, *workload(seed), 150)
    assert on.lengths.declared_only and on.lengths._num_at_limit > 0


class AlwaysPredicting(OutputLengthEstimator):
    """Never takes the shortcut: every projection goes through `predict`."""

    __slots__ = ()

    @property
    def declared_only(self) -> bool:
        return False


@pytest.mark.parametrize("seed", range(3))
def test_the_declared_only_shortcut_changes_no_decision(seed):
    """Generous limits with EOS: the shortcut (use the limit while no early stop
    is in the window or too few finished) decides as calling `predict` always."""
    common = dict(num_blocks=40, block_size=4, max_num_seqs=8, max_model_len=48,
                  admission_headroom_steps=16, length_estimate_min_samples=4,
                  length_estimate_window=6)
    fast = make_scheduler(**common)
    slow = make_scheduler(**common)
    c = slow.config
    slow.lengths = AlwaysPredicting(c.length_estimate_window, c.length_estimate_min_samples,
                                    c.length_estimate_quantile)
    assert drive(fast, *workload(seed, eos=True), 150) == drive(slow, *workload(seed, eos=True), 150)


def test_prediction_admits_more_when_requests_stop_early():
    """After requests with a generous max_tokens have stopped early on EOS, the
    projection uses their lengths: more requests run at once than when it trusts
    max_tokens, and every request still finishes."""
    assert (peak_batch_after_early_stops(predict_output_lengths=True)
            > peak_batch_after_early_stops(predict_output_lengths=False))


def peak_batch_after_early_stops(prompt_len: int = 4, count: int = 12, **config) -> int:
    """Four requests with a generous max_tokens stop on EOS after 3 tokens; then
    `count` more of `prompt_len` tokens arrive, which stop the same way. The most
    requests any step from their arrival on runs (all must finish)."""
    s = make_scheduler(num_blocks=48, block_size=4, max_num_seqs=16, max_model_len=64,
                       admission_headroom_steps=64, length_estimate_min_samples=4, **config)
    arrivals = {0: [make_request(f"w{i}", 4, max_tokens=56) for i in range(4)],
                20: [make_request(f"r{i}", prompt_len, max_tokens=60 - prompt_len)
                     for i in range(count)]}
    eos_after = {f"w{i}": 3 for i in range(4)} | {f"r{i}": 3 for i in range(count)}
    plans = drive(s, arrivals, eos_after, 60)
    assert not s.has_work()
    return max(len(p[0]) for p in plans[20:])


@pytest.mark.parametrize("seed", range(3))
def test_the_predicted_margins_change_no_decision_with_exact_max_tokens(seed):
    """max_tokens exact: no request stops early, so nothing is learnt and the
    margins for predicted ends are never used, whatever they are."""
    common = dict(num_blocks=40, block_size=4, max_num_seqs=8, max_model_len=48,
                  admission_headroom_steps=16, admission_growth_share=0.95,
                  admission_watermark=0.1, length_estimate_min_samples=1)
    a = make_scheduler(predicted_watermark=0.0, predicted_growth_share=0.0, **common)
    b = make_scheduler(predicted_watermark=0.3, predicted_growth_share=1.0, **common)
    assert drive(a, *workload(seed), 150) == drive(b, *workload(seed), 150)
    assert not a.lengths.learnt and a.lengths._num_at_limit > 0


def test_the_reserve_takes_the_predicted_margins_once_early_stops_are_learnt():
    """The reserve is the declared-limit margin until enough requests have stopped
    early, then the predicted-end margin: the watermark and the growth share."""
    s = make_scheduler(num_blocks=100, admission_watermark=0.2, admission_growth_share=1.0,
                       predicted_watermark=0.05, predicted_growth_share=0.5,
                       length_estimate_min_samples=2)
    s.add_request(make_request("running", 4, max_tokens=40))
    s.schedule(0.0)
    assert s._admission_reserve(0.0) == 20 and s._admission_reserve(30.0) == 30
    s.lengths.observe(3, at_limit=False)
    assert s._admission_reserve(30.0) == 30  # one finish: not learnt yet
    s.lengths.observe(5, at_limit=False)
    assert s.lengths.learnt
    assert s._admission_reserve(0.0) == 5 and s._admission_reserve(30.0) == 15


def test_the_smaller_predicted_watermark_admits_more_once_lengths_are_learnt():
    """Generous limits ending on EOS: once early stops are learnt, a smaller
    predicted-end watermark runs more requests at once than the declared-limit
    one would, and every request still finishes."""
    def run(predicted_watermark: float) -> int:
        return peak_batch_after_early_stops(12, 16, admission_watermark=0.25,
                                            predicted_watermark=predicted_watermark)
    assert run(0.0) > run(0.25)


def _drive_recording_hold(s, arrivals, eos_after, steps):
    """`drive`, also returning per step whether the thrash margins were held."""
    plans, held = [], []
    for t in range(steps):
        plans.append(drive_step(s, arrivals, eos_after, t))
        held.append(s._thrash_margins_until > 0)
    return plans, held


THRASH = dict(num_blocks=24, block_size=4, max_num_seqs=8, max_model_len=48,
              admission_headroom_steps=16, length_estimate_min_samples=2,
              length_estimate_window=8, predicted_watermark=0.0, thrash_watermark=0.2)


def _assert_alike_until_the_window_holds(first_scheduler, other, seed: int) -> None:
    """Drive both on the seed's generous workload: their plans differ somewhere, and
    only after the first scheduler's thrash window has held."""
    plans, held = _drive_recording_hold(first_scheduler, *workload(seed, eos=True), 150)
    other_plans, _ = _drive_recording_hold(other, *workload(seed, eos=True), 150)
    first = next((i for i, (a, b) in enumerate(zip(plans, other_plans)) if a != b), None)
    assert first is not None, "the trace never made the thrash window hold"
    assert any(held[:first]), f"plans differ at step {first} before the thrash window held"


@pytest.mark.parametrize("seed", range(6))
def test_the_thrash_window_changes_no_decision_before_preemptions_repeat(seed):
    """Generous limits with EOS, memory short: the plans with the thrash window
    on are those with it off up to the step where two growth preemptions came
    within the window (the rule fired), and differ only after it, with fewer
    preemptions."""
    on = make_scheduler(thrash_window_steps=8, **THRASH)
    off = make_scheduler(thrash_window_steps=0, **THRASH)
    _assert_alike_until_the_window_holds(on, off, seed)
    # What it is for: fewer preemptions, every request finished.
    assert on.collector.num_preemptions < off.collector.num_preemptions
    assert not on.has_work() and not off.has_work()


def test_repeated_growth_preemptions_keep_the_thrash_margins():
    """Two growth preemptions within the window hold the thrash margins for the
    window's steps; a lone one, or one in the same step, changes nothing."""
    s = make_scheduler(num_blocks=100, thrash_watermark=0.2, predicted_watermark=0.0,
                       predicted_growth_share=0.5, length_estimate_min_samples=2,
                       thrash_window_steps=10)
    s.lengths.observe(3, at_limit=False)
    s.lengths.observe(5, at_limit=False)
    s.add_request(make_request("running", 4, max_tokens=40))
    s.schedule(0.0)
    s.step_id = 20
    s._note_growth_preemption()
    s._note_growth_preemption()  # the same step: one shortage
    assert s._margins()[1] == 0 and s._admission_reserve(0.0) == 0
    s.step_id = 31
    s._note_growth_preemption()  # 11 steps later: outside the window
    assert s._margins()[1] == 0
    s.step_id = 40
    s._note_growth_preemption()  # 9 steps later: inside it
    assert s._margins() == (s.config.thrash_growth_share, 20)
    s.step_id = 50
    assert s._margins()[1] == 20
    s.step_id = 51
    assert s._margins()[1] == 0


def test_the_thrash_window_does_nothing_with_exact_max_tokens():
    """Nothing learnt (every request runs to its limit): preemptions leave the
    margins as they are."""
    s = make_scheduler(num_blocks=100, length_estimate_min_samples=1, thrash_window_steps=10)
    s.lengths.observe(7, at_limit=True)
    for step in (1, 2, 3):
        s.step_id = step
        s._note_growth_preemption()
    assert s._last_growth_preemption is None and s._thrash_margins_until == 0


@pytest.mark.parametrize("seed", range(6))
def test_the_thrash_margins_change_no_decision_outside_the_thrash_window(seed):
    """Generous limits with EOS, memory short: schedulers that differ only in the
    thrash margins plan alike up to the first step the thrash window holds."""
    strict = make_scheduler(thrash_window_steps=8, **THRASH)
    loose = make_scheduler(thrash_window_steps=8, **{**THRASH, "thrash_watermark": 0.0,
                                                     "thrash_growth_share": 0.5})
    _assert_alike_until_the_window_holds(strict, loose, seed)
    # What they are for: the margin beyond predictions that proved short preempts less.
    assert strict.collector.num_preemptions < loose.collector.num_preemptions
    assert not strict.has_work() and not loose.has_work()


def test_the_thrash_margins_are_their_own():
    """Declared-limit margins set to the whole projection and no watermark leave
    the thrash margins (by default a 1% watermark and 95% of the projection) in
    force once the predictions have proved short: lowering one does not undo the
    other."""
    from cadence.statemachine.config import CacheConfig, SchedulerConfig
    from cadence.statemachine.scheduler import Scheduler
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                  admission_watermark=0.0, admission_growth_share=1.0,
                                  length_estimate_min_samples=2, thrash_window_steps=10),
                  CacheConfig(num_blocks=400, block_size=4))
    s.add_request(make_request("running", 4, max_tokens=40))
    s.schedule(0.0)
    assert s._admission_reserve(0.0) == 0 and s._admission_reserve(30.2) == 31
    s.lengths.observe(3, at_limit=False)
    s.lengths.observe(5, at_limit=False)
    s.step_id = 20
    s._note_growth_preemption()
    s.step_id = 25
    s._note_growth_preemption()  # within the window: the thrash margins hold
    assert s._admission_reserve(0.0) == 4 and s._admission_reserve(30.0) == 29
