"""Environment variables that only take effect when an interpreter starts.

A warm process (a daemon's spare, agent/spare.py; a fork server's child, agent/forkserver.py) has started
already, so it cannot take these on from a job: a job whose environment differs from the warm process's
in any of them starts its agents cold instead.
"""

from __future__ import annotations

from collections.abc import Mapping

# Read when an interpreter or a native library starts: the Python runtime's own settings, the dynamic
# loader, glibc malloc, OpenMP/BLAS thread pools, locale, which devices CUDA/ROCm enumerate, and torch's
# import-time switches.
_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_",
             "VECLIB_", "NUMEXPR_", "CUDA_", "HIP_", "ROCR_", "TORCH_", "PYTORCH_", "LC_")
_NAMES = frozenset({"GLIBC_TUNABLES", "LANG", "LANGUAGE", "TZ", "TMPDIR"})


def startup_differences(env: Mapping[str, str], warm_env: Mapping[str, str]) -> list[str]:
    """Variables that only take effect at interpreter start and differ between a job's env and a warm
    process's."""
    keys = env.keys() | warm_env.keys()
    return sorted(k for k in keys if (k in _NAMES or k.startswith(_PREFIXES)) and env.get(k) != warm_env.get(k))
