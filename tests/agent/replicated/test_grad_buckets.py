"""The default-mode gradient flush in persistent buckets, started while the last hosted worker's backward
runs (agent/replicated/buckets.py): how parameters are laid out, and that the overlapped flush gives the
parameters of one flat all-reduce after backward, bitwise (M=2: each element is a sum of two, which no
split of the buffer can reorder). Equivalence with DDP under small buckets: tests/system/test_equivalence.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from util import JOBS, REFERENCE_WORKERS, cli, load_state

from elasticd.agent.replicated.buckets import BUCKET_ENV, DEFAULT_BUCKET_KB, GroupLayout, bucket_bytes


def params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(s, dtype=dtype) for s in shapes]


def test_buckets_hold_parameters_in_reverse_order_up_to_the_cap_with_flags_and_vote_in_the_last() -> None:
    ps = params((64,), (64,), (16,), (300,))   # 256, 256, 64, 1200 bytes
    layout = GroupLayout(ps, cap=300, vote_width=3)   # a bucket closes at 300 bytes or more, as DDP's
    assert [b.members for b in layout.buckets] == [[3], [2, 1], [0]]
    first, middle, tail = layout.buckets
    assert first.flags is None and middle.flags is None and first.ballot is None
    assert tail.flags is not None and tail.flags.numel() == 4 and tail.ballot.numel() == 3
    assert tail.flat.numel() == 64 + 4 + 3
    ps[1].grad = torch.ones(64)
    b, slot = layout.where[1]
    b.views[slot].copy_(ps[1].grad)
    assert b is middle and middle.flat[16:16 + 64].sum().item() == 64


def test_each_dtype_has_its_own_buckets_and_only_float_ones_carry_the_vote() -> None:
    ps = [torch.zeros(8), torch.zeros(8, dtype=torch.float16), torch.zeros(4)]
    layout = GroupLayout(ps, cap=0, vote_width=2)
    by = {b.flat.dtype: b for b in layout.buckets}
    assert by[torch.float32].members == [2, 0] and by[torch.float32].ballot.numel() == 2
    assert by[torch.float16].members == [1] and by[torch.float16].ballot is None
    assert by[torch.float16].flags.numel() == 1


def test_the_bucket_size_comes_from_the_environment_and_bad_values_are_refused() -> None:
    assert bucket_bytes({}) == DEFAULT_BUCKET_KB * 1024
    assert bucket_bytes({BUCKET_ENV: "0"}) == 0
    assert bucket_bytes({BUCKET_ENV: "64"}) == 64 * 1024
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(ValueError, match=BUCKET_ENV):
            bucket_bytes({BUCKET_ENV: bad})


@pytest.mark.timeout(600)
def test_the_overlapped_flush_gives_the_parameters_of_one_flush_after_backward(tmp_path: Path) -> None:
    """tiny_lm (a head only odd ranks train: None on some agents' ranks) on 2 devices, 1 KiB buckets
    against one bucket per dtype reduced after backward (`ELASTICD_BUCKET_KB=0`, today's flush)."""
    got = {}
    for kb in ("0", "1"):
        out = tmp_path / f"kb{kb}.pt"
        run = cli("run", str(JOBS / "tiny_lm.py"), "--workers", str(REFERENCE_WORKERS), "--devices", "2",
                  env={"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_TEST_OUT": str(out),
                       "ELASTICD_TEST_EARLY": "1", BUCKET_ENV: kb}, timeout=300)
        assert run.code == 0, run.output
        got[kb] = load_state(out)
    assert int(got["0"].pop("early")) == 0
    assert int(got["1"].pop("early")) > 0, "no bucket was started while backward ran"
    differ = [k for k in got["0"] if not torch.equal(got["0"][k], got["1"][k])]
    assert not differ, f"overlapped flush changed {differ}"


@pytest.mark.timeout(300)
def test_an_error_caught_inside_an_overlapped_backward_stops_the_run_with_why(tmp_path: Path) -> None:
    """tests/jobs/caught_backward.py: the last hosted worker of each agent raises inside backward after its
    first bucket's all-reduce started, and the job catches it. The run must end at once, naming the cause
    and why it cannot go on (this agent's share of the started sum is already in flight)."""
    run = cli("run", str(JOBS / "caught_backward.py"), "--workers", "4", "--devices", "2",
              env={"ELASTICD_TEST_WORKERS": "4", BUCKET_ENV: "1"}, timeout=240)
    assert run.code != 0, run.output
    assert "Flaky: a batch the job chooses to skip" in run.output, run.output
    assert "raised after 1 of its gradient buckets' all-reduce had started" in run.output, run.output
