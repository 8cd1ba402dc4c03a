"""The results file: one measurement's JSON row, the document (bench/README.md: schema), its
validation, atomic writing and merging with an earlier file."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from .cases import OPS, JSON_IMPLS, RESULT_KEYS, DOCUMENT_KEYS, Case, bytes_moved


@dataclasses.dataclass
class Measurement:
    """One timed (case, op, impl); ``as_json()`` gives exactly the schema's keys."""

    case: Case
    op: str
    impl: str
    median_ms: float
    spread_pct: Optional[float] = None
    peak_mem_bytes: Optional[int] = None

    @property
    def bytes(self) -> int:
        return bytes_moved(self.op, self.case)

    @property
    def GBps(self) -> float:
        return self.bytes / (self.median_ms * 1e6) if self.median_ms > 0 else 0.0

    def as_json(self) -> dict:
        c = self.case
        return {"op": self.op, "impl": self.impl, "dtype": c.dtype_name, "mode": c.mode, "tokens": c.tokens,
                "d_model": c.d_model, "vocab": c.vocab, "median_ms": float(self.median_ms), "bytes": int(self.bytes),
                "GBps": float(self.GBps), "peak_mem_bytes": self.peak_mem_bytes}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device) -> str:
    """The GPU's name, or "CPU <model>, <n> threads": a CPU result is only comparable at the same thread
    count, so the count is part of the name (and of the results file's name)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_model()}, {torch.get_num_threads()} threads"


def device_slug(name: str) -> str:
    """File-name form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _triton_version() -> str:
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:
        return "none"


def make_document(device: torch.device, copy_GBps: float, measurements: Iterable[Measurement],
                  kept_rows: Sequence[dict] = ()) -> dict:
    """The JSON document (bench/README.md: schema); rows of implementations outside the schema's
    ``impl`` enum (``torch``) are left out.  ``kept_rows``: rows of an earlier file (``--merge``),
    dropped where this run measured the same (op, impl, case)."""
    new_rows = [m.as_json() for m in measurements if m.impl in JSON_IMPLS]
    measured = {_key(r) + (r["impl"],) for r in new_rows}
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda or "none",
        "date": datetime.date.today().isoformat(),
        "copy_GBps": float(copy_GBps),
        "cases": [r for r in kept_rows if _key(r) + (r["impl"],) not in measured] + new_rows,
    }


class MergeError(ValueError):
    """--merge was given a results file it cannot merge with."""


def rows_to_merge(path: str, device: torch.device) -> Tuple[List[dict], Optional[str]]:
    """The rows of an earlier results file for the same device, and a note saying what was kept."""
    if not os.path.exists(path):
        return [], None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as error:  # (json.JSONDecodeError is a ValueError)
        raise MergeError(f"--merge: cannot read {path}: {error}") from None
    problems = validate_document(doc)
    if problems:
        raise MergeError(f"--merge: {path} does not follow the schema: {problems[0]}")
    if doc["device"] != device_name(device):
        raise MergeError(f"--merge: {path} was measured on {doc['device']!r}, not {device_name(device)!r}")
    return doc["cases"], (f"merged with {path}: its rows measured on {doc['date']} (copy {doc['copy_GBps']:.1f} "
                          f"GB/s) are kept where this run did not measure the same op, impl and case")


def validate_document(doc) -> List[str]:
    """Problems with ``doc`` against the schema (empty when it conforms)."""
    problems = []
    if not isinstance(doc, dict):
        return [f"document is {type(doc).__name__}, not an object"]
    if set(doc) != set(DOCUMENT_KEYS):
        problems.append(f"document keys {sorted(doc)} != {sorted(DOCUMENT_KEYS)}")
    for key in ("device", "torch", "triton", "cuda", "date"):
        if not isinstance(doc.get(key), str):
            problems.append(f"{key} is not a string")
    if isinstance(doc.get("date"), str) and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]):
        problems.append(f"date {doc['date']!r} is not YYYY-MM-DD")
    if not _is_number(doc.get("copy_GBps")):
        problems.append("copy_GBps is not a number")
    cases = doc.get("cases")
    if not isinstance(cases, list):
        return problems + ["cases is not a list"]
    enums = {"op": OPS, "impl": JSON_IMPLS, "mode": ("add", "concat")}
    for i, row in enumerate(cases):
        if not isinstance(row, dict) or set(row) != set(RESULT_KEYS):
            got = sorted(row) if isinstance(row, dict) else row
            problems.append(f"cases[{i}] keys {got!r} != {sorted(RESULT_KEYS)}")
            continue
        for key, allowed in enums.items():
            if row[key] not in allowed:
                problems.append(f"cases[{i}].{key} = {row[key]!r} not in {allowed}")
        if not isinstance(row["dtype"], str):
            problems.append(f"cases[{i}].dtype is not a string")
        for key in ("tokens", "d_model", "vocab", "bytes"):
            if not (isinstance(row[key], int) and not isinstance(row[key], bool)):
                problems.append(f"cases[{i}].{key} is not an int")
        for key in ("median_ms", "GBps"):
            if not _is_number(row[key]):
                problems.append(f"cases[{i}].{key} is not a number")
        peak = row["peak_mem_bytes"]
        if peak is not None and not (isinstance(peak, int) and not isinstance(peak, bool)):
            problems.append(f"cases[{i}].peak_mem_bytes is neither an int nor null")
    return problems


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def write_document(path: str, doc: dict) -> None:
    """Write atomically (a run cut short leaves the last complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _key(row: dict) -> Tuple:
    return (row["op"], row["dtype"], row["mode"], row["tokens"], row["d_model"], row["vocab"])
