"""Scaling report: efficiency, projected epoch time, device-hours and the verdict, worked out here."""

from __future__ import annotations

import pytest
from stage_results import make_result

from lychee_pipeline.evaluation.scaling import ScalingReport, device_label, scaling_report


def stage(name, devices, pps, device_type="cuda", steps=100, **extra):
    """A stage timed over `steps` steps without per-step timings (its own rate is the one compared)."""
    return make_result(stage=name, devices=devices, device_type=device_type, wall_time_s=3600 / pps * 10,
                       train_pairs=36000, pairs_per_s=pps, peak_mem_gib=[20.0 + i for i in range(devices)],
                       steps=steps, step_seconds=[], **extra)


def test_efficiency_epoch_time_and_gpu_hours():
    report = scaling_report([stage("s1", 1, 100.0), stage("s2", 2, 180.0), stage("s4", 4, 320.0)],
                            full_train_pairs=36_000, mrr_at_10={"s1": 0.5})
    rows = {r.stage: r for r in report.rows}
    assert [rows[s].scaling_efficiency for s in ("s1", "s2", "s4")] == pytest.approx([1.0, 0.9, 0.8])
    assert [rows[s].epoch_time_s for s in ("s1", "s2", "s4")] == pytest.approx([360.0, 200.0, 112.5])
    # device-hours per epoch: 1*360/3600, 2*200/3600, 4*112.5/3600
    assert [rows[s].device_hours_per_epoch for s in ("s1", "s2", "s4")] == pytest.approx([0.1, 1 / 9, 0.125])
    assert [rows[s].relative_device_hours for s in ("s1", "s2", "s4")] == pytest.approx([1.0, 10 / 9, 1.25])
    assert rows["s4"].peak_mem_gib == [20.0, 21.0, 22.0, 23.0] and rows["s4"].peak_mem_gib_max == 23.0
    assert rows["s1"].mrr_at_10 == 0.5 and rows["s2"].mrr_at_10 is None
    assert rows["s4"].label == "4 GPUs"
    assert report.most_cost_effective.devices == 1
    assert report.fastest.devices == 4
    assert report.summary.startswith("Most cost-effective: 1 GPU (s1)")


def test_superlinear_scaling_wins_on_cost():
    report = scaling_report([stage("s1", 1, 100.0), stage("s2", 2, 220.0)], full_train_pairs=1000)
    assert report.rows[1].scaling_efficiency == pytest.approx(1.1)
    assert report.most_cost_effective.devices == 2
    assert "2 GPUs (s2)" in report.summary


def test_cpu_processes_are_labelled_and_their_memory_listed():
    stages = [
        make_result(stage="cpu1", devices=1, device_type="cpu", wall_time_s=50.0, train_pairs=100, pairs_per_s=100 / 50,
                    peak_mem_gib=[1.5], steps=100, step_seconds=[]),
        make_result(stage="cpu2", devices=2, device_type="cpu", wall_time_s=40.0, train_pairs=100, pairs_per_s=100 / 40,
                    peak_mem_gib=[], steps=100, step_seconds=[]),
    ]
    report = scaling_report(stages, full_train_pairs=1000)
    r1, r2 = report.rows
    assert r1.pairs_per_s == pytest.approx(2.0) and r2.pairs_per_s == pytest.approx(2.5)
    assert r2.scaling_efficiency == pytest.approx(2.5 / (2 * 2.0))
    assert r1.peak_mem_gib == [1.5] and r2.peak_mem_gib_max is None
    assert (r1.label, r2.label) == ("1 CPU process", "2 CPU processes")
    assert "CPU-process-hours" in report.summary
    assert device_label(1, "cuda") == "1 GPU"


def test_reference_without_a_one_device_stage():
    report = scaling_report([stage("s2", 2, 200.0), stage("s4", 4, 300.0)], full_train_pairs=600)
    s2, s4 = report.rows
    assert s4.reference_devices == 2
    assert s4.scaling_efficiency == pytest.approx(300.0 * 2 / (4 * 200.0))


def test_without_stages_or_dataset_size():
    assert scaling_report([], 100).summary == "No stage ran, so there is no scaling verdict."
    report = scaling_report([stage("s1", 1, 10.0)], None)
    assert report.rows[0].epoch_time_s is None and report.most_cost_effective is None


def test_efficiency_over_too_few_or_too_unequal_steps_is_marked_not_comparable():
    report = scaling_report([stage("stage_1cpu", 1, 100.0, steps=10, device_type="cpu"),
                             stage("stage_2cpu_final", 2, 196.0, steps=909, device_type="cpu")], full_train_pairs=36_000)
    rows = {r.stage: r for r in report.rows}
    final = rows["stage_2cpu_final"]
    assert final.rate_steps == 908 and rows["stage_1cpu"].rate_steps == 9
    assert final.scaling_efficiency is None and final.relative_device_hours is None
    assert final.raw_efficiency == pytest.approx(0.98) and final.comparable is False
    assert final.not_comparable == ("rates rest on 908 and 9 timed steps (stage_2cpu_final vs stage_1cpu); "
                                       "at least 20 each are needed")
    assert rows["stage_1cpu"].scaling_efficiency == 1.0
    assert "98%" not in report.summary
    unequal = scaling_report([stage("a", 1, 100.0, steps=41), stage("b", 2, 180.0, steps=401)], 36_000).rows[1]
    assert unequal.scaling_efficiency is None and "more than 4x apart" in unequal.not_comparable
    close = scaling_report([stage("a", 1, 100.0, steps=101), stage("b", 2, 180.0, steps=201)], 36_000).rows[1]
    assert close.scaling_efficiency == pytest.approx(0.9) and close.comparable is True


def _timed(name, devices, steps, seconds_per_step, first_steps_s=5.0, device_type="cpu", pairs_per_step=8, skip=()):
    """A stage result with per-step timings: slow warm-up steps 1-2, then `seconds_per_step`."""
    times = [[k, first_steps_s if k <= 2 else seconds_per_step] for k in range(1, steps + 1) if k not in skip]
    total = sum(t for _, t in times)
    return make_result(stage=name, devices=devices, device_type=device_type, steps=steps,
                       train_pairs=steps * pairs_per_step * devices, wall_time_s=total,
                       pairs_per_s=(steps - 1) * pairs_per_step * devices / sum(t for k, t in times if k > 1),
                       step_seconds=times)


def test_stages_are_compared_over_the_same_window_of_steps():
    # a 10-step check stage and a 900-step final stage: the all-steps rates mix in different warm-up shares
    # (the check stage looks half as fast per device); over the same steps 3-10 the per-step speed is equal.
    report = scaling_report([_timed("check_1", 1, 10, 0.5), _timed("final_2", 2, 900, 0.5)], full_train_pairs=8000)
    check, final = report.rows
    assert check.window == final.window == [3, 10] and check.rate_steps == final.rate_steps == 8
    assert check.pairs_per_s == pytest.approx(16.0) and final.pairs_per_s == pytest.approx(32.0)
    assert final.scaling_efficiency == pytest.approx(1.0) and final.comparable
    assert final.pairs_per_s_all_steps > 31.0 and check.pairs_per_s_all_steps < 12.0
    assert final.epoch_time_s == pytest.approx(8000 / 32.0)


def test_a_window_too_short_or_not_timed_everywhere_is_not_comparable():
    short = scaling_report([_timed("a", 1, 5, 0.5), _timed("b", 2, 50, 0.5)], full_train_pairs=None).rows[1]
    assert short.scaling_efficiency is None and "common window (steps 3-5 after 2 warm-up) has 3 steps" in \
        short.not_comparable
    resumed = scaling_report([_timed("a", 1, 20, 0.5), _timed("b", 2, 40, 0.5, skip=range(1, 7))],
                             full_train_pairs=None).rows[1]
    assert resumed.scaling_efficiency is None
    assert resumed.not_comparable == "b did not time steps 3-6 of the common window 3-20 (resumed?)"


def test_the_report_reads_back_from_its_json():
    report = scaling_report([_timed("a", 1, 20, 0.5), _timed("b", 2, 40, 0.5)], full_train_pairs=800)
    again = ScalingReport.model_validate_json(report.model_dump_json())
    assert again == report and again.row("b").window == [3, 20] and again.row("c") is None


def test_stage_results_are_read_as_they_are():
    one = make_result(stage="s1", devices=1, pairs_per_s=100.0, wall_time_s=10.0, train_pairs=1000, steps=30,
                      step_seconds=[])
    two = make_result(stage="s2", devices=2, pairs_per_s=180.0, wall_time_s=10.0, train_pairs=1800, steps=30,
                      step_seconds=[])
    report = scaling_report([one, two], full_train_pairs=36_000)
    assert [r.stage for r in report.rows] == ["s1", "s2"]
    assert report.rows[1].scaling_efficiency == pytest.approx(0.9)
