"""What the benchmark reports say about the machine they ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def load_average() -> str:
    """The 1/5/15-minute load average, e.g. ``0.54/1.09/2.18`` (``?`` if unknown)."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else the platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"
