"""Data shipped inside the package, so a clone or a wheel works on its own.

`traces/`: request-length (and arrival) traces for workloads; `profiles/`: A100/H100 operator and
collective timings for the GPU cost model. Both come from microsoft/vidur (MIT licence; each
folder has LICENSE-vidur and a README on origin and format). They are package data
(pyproject.toml), so a non-editable install has them too.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TRACES_DIR = DATA_DIR / "traces"
PROFILES_DIR = DATA_DIR / "profiles"
