"""Content digests of weight files: every byte hashed, cached per file across restarts.

A file's digest is the xxh3-128 of all its bytes. Digests are cached in one small JSON file under the
user's cache directory (``$XDG_CACHE_HOME/vllm-omni-kv/weights-digests.json``, else
``~/.cache/vllm-omni-kv/``), keyed by the file's real path and valid only while its
size, ``mtime_ns``, ``ctime_ns``, inode and device are unchanged (``ctime`` cannot be
set back by a user, so a file rewritten in place is hashed again). A file whose
timestamps are less than :attr:`DigestCache.settle_s` old, or that changed while it
was hashed, is hashed but not cached.

The cache is read only when it is a regular file of this user that nobody else may
write (opened without following links); a cache that fails any check, or any entry
of it that is malformed, is ignored. It is rewritten atomically (a private temporary
file renamed over it), so concurrent engines never read a partial one.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from vllm_omni_kv.logger import init_logger

logger = init_logger(__name__)

#: bytes hashed per step
READ_BYTES = 64 << 20
CACHE_FILE = "weights-digests.json"
CACHE_VERSION = 1
#: a larger cache file is ignored
MAX_CACHE_BYTES = 4 << 20
#: entries kept (the most recently used first)
MAX_ENTRIES = 4096
_HEX = frozenset("0123456789abcdef")

#: (size, mtime_ns, ctime_ns, inode, device): what must be unchanged for a cached digest
StatKey = tuple[int, int, int, int, int]


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def hash_file(path: Path) -> str:
    """The xxh3-128 of every byte of ``path`` (hex), read through a private read-only
    map in :data:`READ_BYTES` steps (as vLLM's safetensors loader maps the same file)."""
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            with contextlib.suppress(AttributeError, OSError):
                m.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(m) as view:
                for at in range(0, size, READ_BYTES):
                    h.update(view[at : at + READ_BYTES])
    return h.hexdigest()


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/vllm-omni-kv/weights-digests.json`` (XDG's default: ``~/.cache``)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "vllm-omni-kv" / CACHE_FILE


def _private(st: os.stat_result) -> bool:
    """Owned by this user and writable by nobody else."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _entry(key: Any, value: Any) -> tuple[str, StatKey, str] | None:
    """A cache entry ``path: [size, mtime_ns, ctime_ns, inode, device, digest]``, checked."""
    if not isinstance(key, str) or not key.startswith("/") or "\0" in key:
        return None
    if not isinstance(value, list) or len(value) != 6:
        return None
    *nums, digest = value
    if not all(type(n) is int and 0 <= n < 1 << 64 for n in nums):
        return None
    if not isinstance(digest, str) or len(digest) != 32 or not set(digest) <= _HEX:
        return None
    return key, (nums[0], nums[1], nums[2], nums[3], nums[4]), digest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def parse_cache(text: bytes) -> dict[str, tuple[StatKey, str]]:
    """The valid entries of a cache file's bytes (none when the file is not one)."""
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or type(doc.get("version")) is not int:
        return {}
    if doc["version"] != CACHE_VERSION:
        return {}
    files = doc.get("files")
    if not isinstance(files, dict):
        return {}
    out: dict[str, tuple[StatKey, str]] = {}
    for k, v in files.items():
        e = _entry(k, v)
        if e is not None:
            out[e[0]] = (e[1], e[2])
    return out


@dataclass
class DigestCache:
    """Cached file digests at ``path`` (None: no cache, every file is hashed)."""

    path: Path | None
    #: files whose mtime or ctime is younger than this are not cached (a write within
    #: the file system's timestamp granularity would leave its stat key unchanged)
    settle_s: float = 2.0
    entries: dict[str, tuple[StatKey, str]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    _dirty: bool = False

    @classmethod
    def default(cls) -> DigestCache:
        try:
            return cls(default_cache_path())
        except (RuntimeError, KeyError):  # no home directory
            return cls(None)

    def load(self) -> None:
        """Read the cache file (nothing when it is absent, foreign or malformed)."""
        self.entries = {}
        if self.path is None:
            return
        try:
            if not _private(os.stat(self.path.parent)):
                return
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _private(st) or st.st_size > MAX_CACHE_BYTES:
                logger.warning("ignoring weights digest cache %s: not a private file", self.path)
                return
            with os.fdopen(os.dup(fd), "rb") as f:
                text = f.read(MAX_CACHE_BYTES + 1)
        except OSError:
            return
        finally:
            os.close(fd)
        self.entries = parse_cache(text)

    def digest(self, path: Path) -> str:
        """The digest of ``path``'s bytes, from the cache when its stat key is unchanged."""
        real = os.path.realpath(path)
        before = os.stat(real)
        key = stat_key(before)
        hit = self.entries.get(real)
        if hit is not None and hit[0] == key:
            self.hits += 1
            self.entries[real] = self.entries.pop(real)  # most recently used last
            return hit[1]
        self.misses += 1
        digest = hash_file(Path(real))
        newest = max(before.st_mtime_ns, before.st_ctime_ns)
        settled = time.time_ns() - newest >= self.settle_s * 1e9
        if settled and stat_key(os.stat(real)) == key:
            self.entries.pop(real, None)
            self.entries[real] = (key, digest)
            self._dirty = True
        return digest

    def save(self) -> None:
        """Write the cache back when it changed (atomically; errors are logged, not raised)."""
        if self.path is None or not self._dirty:
            return
        kept = list(self.entries.items())[-MAX_ENTRIES:]
        doc = {
            "version": CACHE_VERSION,
            "files": {k: [*key, digest] for k, (key, digest) in kept},
        }
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not _private(os.stat(self.path.parent)):
                return
            fd, tmp = tempfile.mkstemp(prefix=".weights-", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            logger.info("weights digests not cached in %s: %s", self.path, e)
            return
        self._dirty = False


def file_digests(paths: Iterable[Path], cache: DigestCache) -> list[str]:
    """The digest of each file, through ``cache`` (loaded before, saved after)."""
    cache.load()
    try:
        return [cache.digest(p) for p in paths]
    finally:
        cache.save()
