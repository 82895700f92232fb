"""How often a job takes a periodic snapshot: parsed from `--snapshot-every`, without torch (the launcher,
the daemon and the CLI check it too)."""

from __future__ import annotations

from dataclasses import dataclass

# On by default: a write in the background every half minute costs a copy to host memory at one step
# boundary (figures in docs/benchmarks.md: scripts/bench_recovery.py), and bounds what a failure redoes.
DEFAULT_SNAPSHOT_EVERY = "30s"
# Restarts after an infrastructure failure before the job fails (torchrun's --max-restarts; its default is 0).
DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True, slots=True)
class Every:
    """How often: every `steps` steps, or every `seconds` seconds (one of them; both 0: never)."""

    steps: int = 0
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Every:
        """"20" (steps), "30s" (seconds), "0" (off).

        Raises:
            ValueError: anything else.
        """
        t = text.strip().lower()
        try:
            if t.endswith("s"):
                value = float(t[:-1])
                if value < 0 or value != value or value == float("inf"):
                    raise ValueError
                return cls(seconds=value)
            steps = int(t)
            if steps < 0:
                raise ValueError
            return cls(steps=steps)
        except ValueError:
            raise ValueError(f"snapshot interval {text!r}: expected a number of steps (20), of seconds (30s), "
                             f"or 0 for none") from None

    @property
    def off(self) -> bool:
        return self.steps == 0 and self.seconds == 0

    def __str__(self) -> str:
        return "0" if self.off else (str(self.steps) if self.steps else f"{self.seconds:g}s")
