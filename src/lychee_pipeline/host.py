"""What the machine offers this process (Kedro-free, imported by the model library and by training)."""

from __future__ import annotations

import os


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask, which a container or `taskset` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
