"""Start-up cost of the weights identity on a multi-GB checkpoint.

Writes a safetensors-like file (8-byte header length, JSON header, then ``--gib`` GiB
of tensor bytes) in a temporary directory, and times ``weights_fingerprint`` over it:

* cold: the file's pages dropped from the page cache first (``posix_fadvise``
  ``DONTNEED`` after ``fsync``), no digest cache: the first start after a download;
* warm: the file in the page cache, no digest cache (vLLM has just read the weights);
* cached: a later start, the digest read from the cache file (the stat key unchanged).

The file is deleted at the end. ``--out`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

from vllm_omni_kv.connector.compat import weights_fingerprint
from vllm_omni_kv.connector.weights_digest import DigestCache

BLOCK = 64 << 20


def write_checkpoint(path: Path, nbytes: int) -> None:
    header = json.dumps(
        {
            "model.embed_tokens.weight": {
                "dtype": "BF16",
                "shape": [nbytes // 2],
                "data_offsets": [0, nbytes],
            }
        }
    ).encode()
    block = os.urandom(min(BLOCK, nbytes))
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = nbytes
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(model: Path, cache: DigestCache) -> tuple[float, str]:
    t0 = time.perf_counter()
    fp = weights_fingerprint(model, cache)
    return time.perf_counter() - t0, fp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=3.0, help="checkpoint size in GiB")
    ap.add_argument("--dir", default=None, help="where to write it (default: the temp dir)")
    ap.add_argument("--out", default=None, help="JSON file for the numbers")
    args = ap.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // 2 * 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        model, cache_file = Path(tmp) / "model", Path(tmp) / "cache" / "digests.json"
        model.mkdir()
        f = model / "model.safetensors"
        write_checkpoint(f, nbytes)
        time.sleep(2.1)  # older than DigestCache.settle_s, so the digest is cached
        drop_pages(f)
        cold, fp = timed(model, DigestCache(None))
        warm, fp2 = timed(model, DigestCache(None))
        first, fp3 = timed(model, DigestCache(cache_file))  # hashes and fills the cache
        cached, fp4 = timed(model, DigestCache(cache_file))
        assert fp == fp2 == fp3 == fp4
        size = f.stat().st_size
    result = {
        "file_bytes": size,
        "cold_s": round(cold, 3),
        "cold_gbps": round(size / cold / 1e9, 2),
        "warm_s": round(warm, 3),
        "warm_gbps": round(size / warm / 1e9, 2),
        "first_with_cache_s": round(first, 3),
        "cached_s": round(cached, 6),
        "cpu": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
