"""``python -m simulator calibrate`` and ``python -m simulator schedule`` end to end.

.venv/bin/python -m pytest tests/unit/test_cost_calibrate.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from processes import run_python

from mpipar.debug.timeline import Timeline
from simulator.__main__ import main as simulator_main
from simulator.cost import HardwareProfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.mpi
def test_calibrate_writes_a_loadable_profile(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = run_python("-m", "simulator", "calibrate", "--quick", "-o", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "point-to-point: alpha" in proc.stdout and f"wrote {out}" in proc.stdout
    profile = HardwareProfile.load(out)
    assert profile.intra_node.bandwidth_Bps > 0 and profile.intra_node.alpha_s >= 0
    assert set(profile.flops_per_s) == {"float64", "float32"}
    assert all(rate > 0 for rate in profile.flops_per_s.values())
    cal = profile.calibration
    assert cal is not None and cal["ranks"] == 2 and cal["blas_threads_per_rank"] == 1
    assert cal["pingpong"]["bytes"] == [8, 16384, 1 << 20]
    assert len(cal["pingpong"]["seconds"]) == 3 and all(t > 0 for t in cal["pingpong"]["seconds"])
    # Bigger messages take longer: the measurements are real, not placeholders.
    assert cal["pingpong"]["seconds"][-1] > cal["pingpong"]["seconds"][0]
    assert cal["seconds_taken"] < 30
    # The CPU model: GEMM shares and elementwise rates by size, host costs, all from this run.
    assert len(profile.gemm_curve) >= 3 and 0 < max(e for _, e in profile.gemm_curve) <= 1.0
    assert [b for b, _ in profile.vector_curve] == sorted(b for b, _ in profile.vector_curve) and len(
        profile.vector_curve
    ) == 6
    assert profile.op_overhead_s > 0 and profile.update_overhead_s > 0 and profile.reshard_overhead_s >= 0
    assert cal["host_costs"]["op"] == profile.op_overhead_s
    assert cal["host_costs"]["optimizer_op"] == profile.optimizer_op_overhead_s >= 0
    assert cal["host_costs"]["grad_sync"] == profile.grad_sync_s >= 0
    # The kernel probe: measured and priced at both batches, and the scale from them (or why not).
    probe = cal["kernel_probe"]
    assert set(probe["measured_s"]) == set(probe["priced_s"]) == {"2", "16"}
    assert all(t > 0 for t in (*probe["measured_s"].values(), *probe["priced_s"].values()))
    assert profile.kernel_scale == probe.get("kernel_scale", 1.0) and ("kernel_scale" in probe) != ("error" in probe)


def test_schedule_subcommand_prints_grid_and_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timeline_path, trace_path, csv_path = tmp_path / "t.json", tmp_path / "trace.json", tmp_path / "s.csv"
    with pytest.raises(SystemExit) as info:
        simulator_main(
            [
                "schedule",
                "Interleaved1F1B",
                "-p",
                "2",
                "-v",
                "2",
                "-m",
                "4",
                "-o",
                str(timeline_path),
                "--chrome",
                str(trace_path),
                "--csv",
                str(csv_path),
            ]
        )
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("Interleaved1F1B: 4 stages on 2 ranks, 4 micro-batches\nstep  rank 0  rank 1\n")
    # (p-1)/(v*m+p-1) = 1/9
    assert "bubble fraction 0.1111" in out
    assert "rank 1: busy 24, bubble 3 (0.1111); peak micro-batches in flight per stage {1: " in out
    timeline = Timeline.load(timeline_path)
    assert timeline.meta["schedule"] == "Interleaved1F1B" and timeline.makespan == 27
    assert "traceEvents" in json.loads(trace_path.read_text())
    assert csv_path.read_text().startswith("rank,index,action,kind,stage,microbatch,peer\n0,0,0F0,F,0,0,\n")


def test_schedule_subcommand_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        simulator_main(["schedule", "Zigzag", "-p", "2", "-m", "2"])
    assert info.value.code == 2
    assert "unknown pipeline schedule kind 'Zigzag'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulator_main(["schedule", "ZBH1", "-p", "2", "-m", "2", "--times", "1,2"])
    assert "--times takes three numbers F,B,W" in capsys.readouterr().err


def test_schedule_subcommand_with_times(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        simulator_main(["schedule", "ZBH1", "-p", "4", "-m", "8", "--times", "2,2,1"])
    out = capsys.readouterr().out
    # ZBH1 bubble (p-1)(tF+tB-tW) = 3 * 3 = 9 per rank.
    assert "rank 0: busy 40, bubble 9 (" in out


def test_scripts_still_run_next_to_subcommands(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('args', sys.argv[1:])\n")
    proc = run_python("-m", "simulator", "-n", "2", str(script), "schedule", "-x", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "args ['schedule', '-x']" in proc.stdout
