"""The agent's command line is derived from AgentConfig's fields: every field survives the round trip."""

from __future__ import annotations

import dataclasses

import pytest

from elasticd.core.agent_config import AgentConfig, parse_args


def test_every_field_survives_the_command_line():
    # A value different from the default for every field, so that to_argv must write each one.
    cfg = AgentConfig(script="/s.py", workers=8, rank=1, world=4, func="train", device_type="cuda", device_index=3,
                      master_addr="10.0.0.1", master_port=1234, job_id="j1", control="pipe:3,4",
                      error_file="/tmp/e.json", threads=2, join_from=2, standby=True, device_memory=1 << 20,
                      snapshot_dir="/dev/shm/x", restore_epoch=5, hold_at=(3, 9),
                      snapshot_every="20", restore_latest=True, blocks=(1, 3, 2, 2), cpu_slots=4)
    defaults = {f.name: f.default for f in dataclasses.fields(AgentConfig)}
    assert all(getattr(cfg, k) != v for k, v in defaults.items()), "the test must set every field"
    assert parse_args(cfg.to_argv()) == cfg


def test_defaults_are_left_off_the_command_line():
    cfg = AgentConfig(script="/s.py", workers=4, rank=0, world=2)
    assert cfg.to_argv() == ["--script", "/s.py", "--workers", "4", "--rank", "0", "--world", "2"]
    assert parse_args(cfg.to_argv()) == cfg


@pytest.mark.parametrize("argv, message", [
    (["--script", "s.py", "--workers", "4", "--rank", "0", "--world", "8"], "devices"),
    (["--script", "s.py", "--workers", "4", "--rank", "0", "--world", "2", "--restore-epoch", "1"],
     "--restore-epoch needs --snapshot-dir"),
    (["--script", "s.py", "--workers", "4", "--rank", "0", "--world", "2", "--device-type", "tpu"], "invalid choice"),
    (["--script", "s.py", "--workers", "8", "--rank", "0", "--world", "2", "--blocks", "6,3"], "sum to 9"),
])
def test_bad_command_lines_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
