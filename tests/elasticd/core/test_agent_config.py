"""The agent's command line is derived from AgentConfig's fields: every field survives the round trip."""

from __future__ import annotations

import dataclasses

import pytest

from elasticd.core.agent_config import AgentConfig, cuda_ordinal, joined, parse_args


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


@pytest.mark.parametrize("spares_order", ["fresh_first", "leaver_first"])
def test_a_joining_standby_takes_the_gpu_its_join_names_never_the_one_it_had(spares_order: str) -> None:
    """A grow from 3 to 4 agents on a 4-GPU node: agent 2 left the shrink and waits warm with GPU 2's launch
    record, a spare waits with GPU 3's; the grow hands them ranks 2 and 3 in either order, each join naming
    its rank's GPU (the node's `AgentJoin.device_index`). The four agents hold four GPUs."""
    gpus = 4
    survivors = {r: cuda_ordinal(r, r, gpus) for r in (0, 1)}
    leaver = AgentConfig(script="/s.py", workers=8, rank=2, world=3, device_type="cuda", device_index=2, standby=True)
    fresh = AgentConfig(script="/s.py", workers=8, rank=0, world=1, device_type="cuda", device_index=3, standby=True)
    standbys = [fresh, leaver] if spares_order == "fresh_first" else [leaver, fresh]
    got = dict(survivors)
    for rank, cfg in zip((2, 3), standbys, strict=True):
        cfg = joined(cfg, rank, 4, 2, "127.0.0.1", 29500, device_index=rank)
        assert cfg.standby is False and cfg.world == 4 and cfg.join_from == 2
        got[rank] = cuda_ordinal(cfg.device_index, cfg.rank, gpus)
    assert got == {0: 0, 1: 1, 2: 2, 3: 3}
