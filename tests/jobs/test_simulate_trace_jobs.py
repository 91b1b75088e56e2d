"""The failure-trace simulator against reality: its prediction of a real local job with
failures (the simulator itself: tests/unit/test_simulate_trace.py)."""

from __future__ import annotations

from jobs import ROOT


def test_the_simulator_predicts_a_local_job_with_three_kills(tmp_path):
    """The GPT example on 5 local nodes, 3 of them SIGKILLed (the third leaves no replica of some
    layers: a checkpoint restore), predicted from its own profiles (taken alone just before and
    just after it: Note: [profiles around the job] in benchmarks/simulator_vs_job.py) and its
    kill times with the shipped recovery constants, never fitted to this run
    (benchmarks/simulator_vs_job.py also fits them to a calibration run)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from simulator_vs_job import MEASURED_KILLS, kill_trace, predict_around, profiles_around, run

    own, after = profiles_around(tmp_path)  # measured alone, not beside other tests' jobs
    start, measured, _ = run(tmp_path, "run", MEASURED_KILLS, own)
    row = predict_around(tmp_path, after(), kill_trace(tmp_path, "run", start), [])
    assert (row["recoveries"], row["fallbacks"]) == (3, 1), row
    print(f"predicted {row['finished_at_s']:.2f} s, measured {measured:.2f} s: {row['finished_at_s'] / measured:.3f}")
    # a gross error only: how close the prediction comes (within a quarter) is the benchmark's
    # figure (benchmarks/simulator_vs_job.py), not a timing threshold of the suite, where one
    # job on a shared 2-core machine measures 0.70-0.84 of its prediction from run to run
    assert 0.5 <= row["finished_at_s"] / measured <= 2.0, (row["each_s"], measured)
