"""The weights identity counts every byte (``connector/weights_digest.py``): a twin
checkpoint that differs only between the windows a sampling fingerprint reads gets
another identity, and the per-file digest cache is used only while a file's stat key is
unchanged, only when it is private, and never when malformed.

Expected digests come from ``xxhash`` over the file bytes, computed here."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from vllm_omni_kv.connector.compat import weights_fingerprint
from vllm_omni_kv.connector.weights_digest import (
    CACHE_FILE,
    DigestCache,
    default_cache_path,
    parse_cache,
)

K_PROJ = "model.layers.0.self_attn.k_proj.weight"
#: the sampling fingerprint of attack 6: files above 64 MiB were read as the safetensors
#: header and 64 evenly spaced windows of 64 KiB
OLD_WHOLE, OLD_SAMPLES, OLD_WINDOW = 64 << 20, 64, 64 << 10


def _old_windows(size: int, header_end: int) -> list[tuple[int, int]]:
    starts = [(size - OLD_WINDOW) * i // (OLD_SAMPLES - 1) for i in range(OLD_SAMPLES)]
    return [(0, header_end)] + [(s, s + OLD_WINDOW) for s in starts]


def _xxh(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


@pytest.fixture
def big_checkpoint(tmp_path: Path) -> Path:
    """A model dir whose one safetensors file (72 MiB of k_proj, 1 MiB of v_proj) is
    above the old whole-file limit."""
    d = tmp_path / "model"
    d.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file(
        {
            K_PROJ: torch.randn(4608, 4096, generator=g),
            "model.layers.0.self_attn.v_proj.weight": torch.randn(512, 512, generator=g),
        },
        str(d / "model.safetensors"),
    )
    return d


def test_a_twin_differing_between_the_old_samples_has_another_identity(
    big_checkpoint: Path, tmp_path: Path
) -> None:
    f = big_checkpoint / "model.safetensors"
    raw = bytearray(f.read_bytes())
    assert len(raw) > OLD_WHOLE
    (n,) = struct.unpack("<Q", raw[:8])
    a, b = json.loads(raw[8 : 8 + n])[K_PROJ]["data_offsets"]
    windows = _old_windows(len(raw), 8 + n)
    # a byte of k_proj halfway between two windows: the sampling fingerprint never read it
    at = (windows[20][1] + windows[21][0]) // 2
    assert 8 + n + a <= at < 8 + n + b
    assert not any(s <= at < e for s, e in windows)
    twin = tmp_path / "twin"
    twin.mkdir()
    raw[at] ^= 0x01
    (twin / "model.safetensors").write_bytes(raw)
    cache = DigestCache(tmp_path / "cache.json", settle_s=0)
    mine, theirs = weights_fingerprint(big_checkpoint, cache), weights_fingerprint(twin, cache)
    assert mine != theirs
    # the same bytes under another path and name are the same weights
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(f, copy / "other-name.safetensors")
    assert weights_fingerprint(copy, cache) == mine
    assert cache.misses == 3


def _one_file(tmp_path: Path, data: bytes = b"weights " * 1000) -> Path:
    f = tmp_path / "m" / "model.safetensors"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(data)
    return f


def _planted(cache_path: Path, f: Path, digest: str) -> None:
    """A cache whose entry for ``f`` (its current stat key) holds ``digest``."""
    st = os.stat(f)
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    doc = {"version": 1, "files": {os.path.realpath(f): [*key, digest]}}
    cache_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    cache_path.write_text(json.dumps(doc))
    cache_path.chmod(0o600)


def _digest(f: Path, cache_path: Path, settle_s: float = 0.0) -> tuple[str, DigestCache]:
    cache = DigestCache(cache_path, settle_s=settle_s)
    cache.load()
    out = cache.digest(f)
    cache.save()
    return out, cache


def test_a_restart_reads_the_cache_instead_of_rehashing(tmp_path: Path) -> None:
    f, cp = _one_file(tmp_path), tmp_path / "c" / CACHE_FILE
    got, first = _digest(f, cp)
    assert got == _xxh(f) and (first.hits, first.misses) == (0, 1)
    again, second = _digest(f, cp)
    assert again == got and (second.hits, second.misses) == (1, 0)
    # the digest is taken from the cache: a planted one for the same stat key is believed
    _planted(cp, f, "ab" * 16)
    assert _digest(f, cp)[0] == "ab" * 16


def test_any_change_of_size_mtime_or_ctime_rehashes(tmp_path: Path) -> None:
    f, cp = _one_file(tmp_path), tmp_path / "c" / CACHE_FILE
    fake = "ab" * 16
    _planted(cp, f, fake)
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # mtime only, same bytes
    assert _digest(f, cp)[0] == _xxh(f)
    # rewritten in place with the same size and mtime put back (cp -p over it): ctime moves
    _planted(cp, f, fake)
    st = os.stat(f)
    with f.open("r+b") as w:
        w.write(b"W")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size == st.st_size and os.stat(f).st_mtime_ns == st.st_mtime_ns
    got, cache = _digest(f, cp)
    assert got == _xxh(f) and cache.misses == 1
    _planted(cp, f, fake)
    with f.open("ab") as w:  # another size
        w.write(b"more")
    assert _digest(f, cp)[0] == _xxh(f)


def test_a_file_younger_than_settle_s_is_hashed_but_not_cached(tmp_path: Path) -> None:
    f, cp = _one_file(tmp_path), tmp_path / "c" / CACHE_FILE
    assert _digest(f, cp, settle_s=3600)[0] == _xxh(f)
    assert not cp.exists()
    _digest(f, cp, settle_s=0)
    assert list(parse_cache(cp.read_bytes())) == [os.path.realpath(f)]


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"\x00\xff garbage",
        b'{"version": 1, "files": {',
        b"[1, 2, 3]",
        b'{"version": 2, "files": {}}',
        b'{"version": 1, "files": []}',
        b'{"version": 1, "files": {"PATH": [KEY, NaN]}}',
        b'{"version": 1, "files": {"PATH": [KEY, Infinity]}}',
        b'{"version": 1, "files": {"PATH": [KEY, "DIGEST", 7]}}',
        b'{"version": 1, "files": {"PATH": [KEY, "zz"]}}',
        b'{"version": 1, "files": {"PATH": [KEY, "DIGESTab"]}}',
        b'{"version": 1, "files": {"PATH": [KEY, "DIGEST"]}, "files": 3}',
        b'{"version": 1.0, "files": {"PATH": [KEY, "DIGEST"]}}',
        b'{"version": 1, "files": {"PATH": [-1, KEY, "DIGEST"]}}',
        b'{"version": 1, "files": {"PATH": [true, KEY, "DIGEST"]}}',
        b'{"version": 1, "files": {"PATH": [1.5, KEY, "DIGEST"]}}',
        b'{"version": 1, "files": {"PATH": {"KEY": "DIGEST"}}}',
        b'{"version": 1, "files": {"RELATIVE": [KEY, "DIGEST"]}}',
        b'{"version": 1, "files": {"PATH": [KEY, "DIGEST"]}}' + b" " * (5 << 20),
        b"[" * 100_000,
    ],
)
def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path: Path, text: bytes) -> None:
    """Each case would name a planted digest for the file's current stat key if the
    parser were lax: the true digest comes back, and the file is rewritten valid."""
    f, cp = _one_file(tmp_path), tmp_path / "c" / CACHE_FILE
    st = os.stat(f)
    real = os.path.realpath(f)
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    for a, b in (
        (b'"PATH"', json.dumps(real)),
        (b'"RELATIVE"', json.dumps(os.path.relpath(real))),
        (b"KEY", ", ".join(map(str, key))),
        (b"DIGEST", "ab" * 16),
    ):
        text = text.replace(a, b.encode())
    cp.parent.mkdir(mode=0o700)
    cp.write_bytes(text)
    cp.chmod(0o600)
    got, cache = _digest(f, cp)
    assert got == _xxh(f) and cache.misses == 1
    assert parse_cache(cp.read_bytes())[real][1] == got  # rewritten whole and valid


def test_one_bad_entry_leaves_the_others(tmp_path: Path) -> None:
    f, cp = _one_file(tmp_path), tmp_path / "c" / CACHE_FILE
    _planted(cp, f, "ab" * 16)
    doc = json.loads(cp.read_text())
    doc["files"]["/elsewhere"] = [1, 2, 3, "4", 5, "cd" * 16]
    cp.write_text(json.dumps(doc))
    assert list(parse_cache(cp.read_bytes())) == [os.path.realpath(f)]
    assert _digest(f, cp)[0] == "ab" * 16


@pytest.mark.parametrize("how", ["group-writable", "world-writable-dir", "symlink", "fifo"])
def test_a_cache_others_could_write_is_not_believed(tmp_path: Path, how: str) -> None:
    f, cp = _one_file(tmp_path), tmp_path / "c" / CACHE_FILE
    fake = "ab" * 16
    _planted(cp, f, fake)
    if how == "group-writable":
        cp.chmod(0o620)
    elif how == "world-writable-dir":
        cp.parent.chmod(0o777)
    elif how == "symlink":
        real = tmp_path / "elsewhere.json"
        cp.rename(real)
        cp.symlink_to(real)
    else:
        cp.unlink()
        os.mkfifo(cp, 0o600)
    assert _digest(f, cp)[0] == _xxh(f)


def test_the_default_cache_is_private_under_xdg_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = default_cache_path()
    assert path == tmp_path / "xdg" / "vllm-omni-kv" / CACHE_FILE
    f = _one_file(tmp_path)
    cache = DigestCache.default()
    cache.settle_s = 0
    assert weights_fingerprint(f.parent, cache) == weights_fingerprint(f.parent, DigestCache(None))
    assert (path.parent.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: XDG says ignore it
    assert default_cache_path() == Path.home() / ".cache" / "vllm-omni-kv" / CACHE_FILE
