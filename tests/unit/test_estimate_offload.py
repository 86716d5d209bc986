"""``python -m simulator estimate --offload``: device memory drops by the optimizer states' bytes,
the step pays their copy there and back over the host link, profiles carry that link's rate."""

from __future__ import annotations

import json
from typing import Any

import pytest

from simulator.cost import HardwareProfile, load_profile
from simulator.estimate import main

MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "100", "--mesh", "dp=2,tp=2"]


def estimate(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main([*MODEL, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("extra", [[], ["--mixed-precision"], ["--zero", "1"]])
def test_offload_drops_device_memory_by_the_optimizer_states(
    capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    plain = estimate(capsys, *extra)
    moved = estimate(capsys, *extra, "--offload")
    states = plain["model_state_by_category"]["optimizer_state"]
    assert all(n > 0 for n in states)
    off = moved["offload"]
    assert off["host_bytes_per_rank"] == states
    assert off["device_peak_bytes_per_rank"] == [
        p - s for p, s in zip(plain["peak_bytes_per_rank"], states, strict=True)
    ]
    assert moved["peak_bytes_per_rank"] == plain["peak_bytes_per_rank"]  # the report without offload stays as it was


def test_states_are_the_adamw_bytes_of_each_ranks_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    """Independent count: AdamW keeps two float32 moments and (mixed precision) a float32 master per element."""
    plain = estimate(capsys)
    mixed = estimate(capsys, "--mixed-precision", "--offload")
    params = plain["model_state_by_category"]["parameters"]  # float32 bytes of each rank's parameters
    assert plain["model_state_by_category"]["optimizer_state"] == [2 * p for p in params]
    assert mixed["offload"]["host_bytes_per_rank"] == [3 * p for p in params]


def test_the_host_link_time_is_added_to_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    plain = estimate(capsys, "--hardware", "a100-nvlink-ib")
    moved = estimate(capsys, "--hardware", "a100-nvlink-ib", "--offload")
    off = moved["offload"]
    assert off["host_link_Bps"] == load_profile("a100-nvlink-ib").host_link_Bps == 25e9
    assert off["transfer_s"] == pytest.approx(2 * max(off["host_bytes_per_rank"]) / 25e9, rel=1e-12)
    assert off["step_time_s"] == pytest.approx(plain["step_time_s"] + off["transfer_s"], rel=1e-12)
    slow = estimate(capsys, "--hardware", "a100-nvlink-ib", "--offload", "--host-link-bandwidth", "1e9")["offload"]
    assert slow["transfer_s"] == pytest.approx(25 * off["transfer_s"], rel=1e-12)


def test_a_cpu_profile_moves_for_free(capsys: pytest.CaptureFixture[str]) -> None:
    off = estimate(capsys, "--hardware", "cpu-local", "--offload")["offload"]
    assert off["host_link_Bps"] is None and off["transfer_s"] == 0.0


def test_text_output_says_what_moved_where(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MODEL, "--offload"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("offload: optimizer states + master weights to host memory") and "host link 50 GB/s" in line


def test_host_link_bandwidth_needs_offload(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*MODEL, "--host-link-bandwidth", "1e9"])
    assert exc.value.code == 2
    assert "--host-link-bandwidth prices --offload's copies" in capsys.readouterr().err


@pytest.mark.parametrize("value", [0, -1.0, "fast", True, float("inf")])
def test_profile_host_link_is_checked(value: object) -> None:
    data = load_profile("a100-nvlink-ib").to_dict()
    data["host_link_Bps"] = value
    with pytest.raises(ValueError, match=r"p\.json: .*host_link_Bps must be > 0 bytes/s or None, got"):
        HardwareProfile.from_dict(data, source="p.json")


def test_profile_host_link_round_trips() -> None:
    profile = load_profile("h100-nvlink-ib")
    assert HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict()))).host_link_Bps == 50e9
    assert "host_link_Bps" not in load_profile("cpu-local").to_dict()
