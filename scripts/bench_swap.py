"""Private-state swap throughput vs a plain `copy_` of the same bytes, in the same run, on one device.

On `--device cuda` the state lives on cuda:0, the swap goes through the CUDA mover (pinned host buffers,
side stream, events) and the baseline copies to pinned host buffers and back with `copy_(non_blocking=True)`;
every timed call ends with a `torch.cuda.synchronize()`, so both sides are timed to completion.

One worker's private state (a list of --slots float32 tensors, --mb MiB in all) is swapped out and back in
through `elasticd.agent.private.registry.PrivateStore`, exactly as a hand-over does it (copy thread, pooled device blocks,
checksum dedup). The baseline copies the same tensors to preallocated host buffers and back with `copy_`.
Throughput = bytes moved (out + in) / time. The machine is shared, so every repetition times all cases
back to back and the "vs memcpy" column is the median over repetitions of that repetition's time ratio
(paired: a noisy moment slows both sides of a ratio); times are medians too. Content changes
between repetitions (outside the timed region) in three ways:

- changed: in-place ops, as training does; version counters prove the change, no checksum is taken;
- changed behind autograd: writes through `.data`; counters stay put, so each slot is checksummed, differs
  and is copied (the worst case: checksum + copy);
- unchanged: counters stay put, checksums match, the swap-out copy is skipped (only the restore copies).

The last line is `swap_vs_memcpy=X.XX`: swap throughput (dedup on, changed content) / memcpy throughput.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from elasticd.agent.private.registry import PrivateStore
from elasticd.agent.private.swap import cpu_checksum
from elasticd.agent.private.swap_cuda import cuda_checksum


def _median_seconds(fn: Callable[[], None], prepare: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        prepare()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="private state in MiB")
    ap.add_argument("--slots", type=int, default=16, help="tensors it is split into")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    cuda = dev.type == "cuda"

    def done(fn: Callable[[], None]) -> Callable[[], None]:
        if not cuda:
            return fn

        def synced() -> None:
            fn()
            torch.cuda.synchronize(dev)
        return synced
    if a.threads:
        torch.set_num_threads(a.threads)

    numel = a.mb * 2**20 // 4 // a.slots
    state = [torch.randn(numel, device=dev) for _ in range(a.slots)]
    nbytes = sum(t.untyped_storage().nbytes() for t in state)
    moved = 2 * nbytes  # out + in

    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in state]

    def memcpy() -> None:
        for h, t in zip(host, state, strict=True):
            h.copy_(t, non_blocking=cuda)
        for h, t in zip(host, state, strict=True):
            t.copy_(h, non_blocking=cuda)

    def in_place() -> None:
        for t in state:
            t.add_(1.0)

    def behind_autograd() -> None:
        for t in state:
            t.data.add_(1.0)

    def nothing() -> None:
        pass

    stores = {dedup: PrivateStore(dev, dedup=dedup) for dedup in (True, False)}
    for store in stores.values():
        store.register(0, state)

    def swap(store: PrivateStore) -> Callable[[], None]:
        def run() -> None:
            store.swap_out(0)
            store.swap_in(0)
        return done(run)

    # (label, timed function, what changes before each repetition, dedup store or None)
    cases: list[tuple[str, Callable[[], None], Callable[[], None], PrivateStore | None]] = [
        ("memcpy (copy_ out and back)", done(memcpy), in_place, None),
        ("swap, dedup off, changed", swap(stores[False]), in_place, stores[False]),
        ("swap, dedup on, changed", swap(stores[True]), in_place, stores[True]),
        ("swap, dedup on, changed behind autograd", swap(stores[True]), behind_autograd, stores[True]),
        ("swap, dedup on, unchanged", swap(stores[True]), nothing, stores[True]),
    ]
    for _, fn, prep, _ in cases:  # warm up: host buffers, pooled blocks, allocator, thread
        for _ in range(2):
            prep()
            fn()
    seconds: dict[str, list[float]] = {label: [] for label, *_ in cases}
    skipped: dict[str, int] = {label: 0 for label, *_ in cases}
    for _ in range(a.reps):  # interleaved, so machine noise hits every case alike
        for label, fn, prep, store in cases:
            before = store.stats.dedup_skipped if store else 0
            seconds[label].append(_median_seconds(fn, done(prep), 1))
            skipped[label] += (store.stats.dedup_skipped - before) if store else 0

    big = torch.cat([t.view(-1) for t in state]).view(torch.uint8)
    checksum_s = _median_seconds(lambda: (cuda_checksum if cuda else cpu_checksum)(big), nothing, a.reps)

    base = seconds[cases[0][0]]
    ratio = {label: statistics.median(b / x for b, x in zip(base, s, strict=True)) for label, s in seconds.items()}
    print(f"private state on {dev}: {nbytes / 2**20:.0f} MiB in {a.slots} slots; torch threads {torch.get_num_threads()}; "
          f"{a.reps} repetitions")
    print(f"{'case':<42} {'ms':>8} {'GB/s':>7} {'vs memcpy':>10} {'slots skipped':>14}")
    for label, s in seconds.items():
        t = statistics.median(s)
        print(f"{label:<42} {t * 1e3:8.2f} {moved / t / 1e9:7.2f} {ratio[label]:10.2f} "
              f"{skipped[label] / a.reps:14.1f}")
    print(f"{'checksum alone (one read of the state)':<42} {checksum_s * 1e3:8.2f} {nbytes / checksum_s / 1e9:7.2f}")
    print(f"swap_vs_memcpy={ratio['swap, dedup on, changed']:.2f}")


if __name__ == "__main__":
    main()
