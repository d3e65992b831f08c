"""Rewriting a wheel without some of its files, and checking a wheel's RECORD.

``strip_wheel`` drops every member under the given top-level prefixes, writes a new
``RECORD`` (sha256 and size of each remaining file, as the wheel format requires) and
replaces the wheel in place, keeping its file name (pip needs the canonical name).
``record_problems`` verifies a wheel against its ``RECORD``: every file listed once, with
the right hash and size.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import zipfile
from pathlib import Path
from typing import Any


def _digest(data: bytes) -> str:
    raw = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _record_name(names: list[str]) -> str:
    found = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(found) != 1:
        raise ValueError(f"expected one .dist-info/RECORD, found {found}")
    return found[0]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p.rstrip("/") or name.startswith(p) for p in prefixes)


def strip_wheel(path: Path, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Rewrite the wheel at ``path`` without the members under ``prefixes`` (``"pkg/"``),
    with a RECORD regenerated for what stays; returns what was removed and both sizes."""
    tmp = path.with_name(path.name + ".tmp")
    removed: list[str] = []
    removed_bytes = 0
    size_before = path.stat().st_size
    with zipfile.ZipFile(path) as src:
        record = _record_name(src.namelist())
        rows = io.StringIO()
        writer = csv.writer(rows, lineterminator="\n")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename == record or info.is_dir():
                    continue
                if _under(info.filename, prefixes):
                    removed.append(info.filename)
                    removed_bytes += info.file_size
                    continue
                data = src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                writer.writerow([info.filename, _digest(data), len(data)])
            writer.writerow([record, "", ""])
            dst.writestr(record, rows.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return {
        "removed_prefixes": list(prefixes),
        "removed_files": sorted(removed),
        "removed_bytes_unpacked": removed_bytes,
        "wheel_bytes_before": size_before,
        "wheel_bytes_after": path.stat().st_size,
    }


def record_problems(path: Path) -> list[str]:
    """What is wrong with the wheel's RECORD (empty: every file listed once, hash and size
    right, nothing listed that is missing)."""
    problems: list[str] = []
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if not n.endswith("/")]
        record = _record_name(names)
        listed: dict[str, tuple[str, str]] = {}
        for row in csv.reader(io.StringIO(z.read(record).decode())):
            if row:
                if row[0] in listed:
                    problems.append(f"{path.name}: {row[0]} listed twice in RECORD")
                listed[row[0]] = (row[1], row[2])
        for name in names:
            if name == record:
                continue
            if name not in listed:
                problems.append(f"{path.name}: {name} is not in RECORD")
                continue
            data = z.read(name)
            if listed[name] != (_digest(data), str(len(data))):
                problems.append(f"{path.name}: {name} does not match its RECORD line")
        missing = sorted(set(listed) - set(names))
        if missing:
            problems.append(f"{path.name}: RECORD lists files the wheel lacks: {missing[:5]}")
    return problems


def members_under(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    """The wheel's members under ``prefixes``."""
    with zipfile.ZipFile(path) as z:
        return [n for n in z.namelist() if _under(n, prefixes)]
