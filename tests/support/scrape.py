"""Reading an elasticd metrics endpoint in tests: GET a path, parse /metrics into samples."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    code, text = get(url + "/metrics")
    assert code == 200, text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict, _metric: str, /, **labels: str) -> float | None:
    return m.get((_metric, frozenset(labels.items())))
