"""The start-up step-time calibration's measured steps, kept on disk per model, engine settings
and machine, so that a restart replays them into the fit instead of timing throwaway requests
again (2-4 s for a 1B model on 2 cores, most of what start-up spends after loading).

Replayed steps only seed the fit: from the first served steps on it follows the host's speed
(`StepCostModel.speed`), so a cache taken on a busier or quieter minute costs a few steps of
error, not a wrong plan. Anything that changes what a step costs (the model file, the
quantization, dtype, threads, the compiled kernels, the CPU, torch) is part of the key.

CARPOOL_STEP_CACHE names the directory (default ~/.cache/carpool/step_times); "off" turns the
cache off. A file that cannot be read or written is logged and ignored: start-up never fails
over its cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from carpool.core.step_cost import BatchShape

log = logging.getLogger("carpool")

CACHE_ENV = "CARPOOL_STEP_CACHE"
FORMAT = "carpool-step-cache/1"


def cache_dir() -> Path | None:
    """Where cached calibrations live, or None when the cache is off."""
    where = os.environ.get(CACHE_ENV)
    if where == "off":
        return None
    return Path(where) if where else Path.home() / ".cache" / "carpool" / "step_times"


def cache_path(identity: dict) -> Path | None:
    """The file for an engine whose steps cost what `identity` (plain JSON values) says."""
    root = cache_dir()
    if root is None:
        return None
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return root / f"{key}.json"


def file_identity(path: str) -> list:
    """A model file's (or folder's files') names, sizes and modification times: a new download or
    conversion under the same name is another model."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def load_steps(path: Path | None) -> list[tuple[BatchShape, float]] | None:
    """The cached steps at `path`, or None (no cache, or a file that is not one)."""
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        steps = [(BatchShape(prefills=tuple(tuple(p) for p in s["prefills"]),
                             decode_contexts=tuple(s["decode_contexts"]), num_sampled=int(s["num_sampled"]),
                             num_drafts=int(s["num_drafts"])), float(s["seconds"]))
                 for s in data["steps"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the step-time cache %s: %s", path, e)
        return None
    return steps or None


def save_steps(path: Path | None, identity: dict, steps: list[tuple[BatchShape, float]]) -> None:
    """Write `steps` for `identity` (atomically: concurrent engines each write a whole file)."""
    if path is None or not steps:
        return
    data = {"format": FORMAT, "identity": identity,
            "steps": [dict(asdict(shape), seconds=seconds) for shape, seconds in steps]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(data, f, default=str)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("could not write the step-time cache %s: %s", path, e)
