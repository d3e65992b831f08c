"""AR -> diffusion in one command: a vLLM AR stage hands its KV to a vLLM-free diffusion stage.

    python examples/ar_to_diffusion/run_demo.py [--prompt ...] [--negative ...] [--out out/image.png]

Generates the tiny model if missing, starts the AR stage (vLLM + OmniKVConnector producer),
waits for its KV, runs the diffusion stage (OmniKVTransferManager + a small denoiser whose
cross-attention reads that KV, with the negative prompt's KV for classifier-free guidance),
prints the timings and the PNG path, and stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _spinner(proc: subprocess.Popen[str], label: str, timeout: float) -> str:
    """Wait for the READY line of ``proc`` with a visible progress indicator."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def pump() -> None:
        for x in stdout:
            lines.put(x)

    threading.Thread(target=pump, daemon=True).start()
    start, frames = time.monotonic(), "|/-\\"
    tty, next_note = sys.stdout.isatty(), 10.0
    while True:
        try:
            line = lines.get(timeout=0.25)
            if line.startswith("READY "):
                print(
                    ("\r" if tty else "")
                    + f"{label}: ready after {time.monotonic() - start:.0f}s   "
                )
                return line[len("READY ") :]
            continue
        except queue.Empty:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited with code {proc.returncode}")
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise TimeoutError(f"{label} not ready after {timeout:.0f}s")
        if tty:
            print(
                f"\r{label}: starting {frames[int(elapsed * 4) % 4]} {elapsed:4.0f}s",
                end="",
                flush=True,
            )
        elif elapsed >= next_note:  # not a terminal: one line every 10 s, not a flood
            print(f"{label}: starting, {elapsed:.0f}s", flush=True)
            next_note += 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--prompt", default="a quiet river garden with silver light on the stone window"
    )
    ap.add_argument("--negative", default="noise static blur")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "image.png")
    ap.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-models" / "demo-ar")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0)
    a = ap.parse_args(argv)

    from vllm_omni_kv.tiny_model import write_tiny_model

    write_tiny_model(a.model)
    ns = f"ar2dit-{os.getpid()}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the AR stage's engine core runs inside the AR stage process: one interpreter, not two
    # (on CPU vLLM spawns a separate engine-core process, which imports vLLM again)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    log = open(a.out.parent.mkdir(parents=True, exist_ok=True) or a.out.with_suffix(".ar.log"), "w")
    ar = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "ar_stage.py"),
            "--model",
            str(a.model),
            "--prompt",
            a.prompt,
            "--negative",
            a.negative,
            "--namespace",
            ns,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    try:
        info = json.loads(_spinner(ar, "AR stage (vLLM producer)", a.timeout))
        print(
            f"AR stage prefilled {info['prompt_tokens']} prompt tokens in {info['prefill_s'] * 1e3:.0f} ms;"
            f" request ids {info['positive']} / {info['negative']}"
        )
        dit = subprocess.run(
            [
                sys.executable,
                str(HERE / "dit_stage.py"),
                "--positive",
                info["positive"],
                "--negative",
                info["negative"],
                "--namespace",
                ns,
                "--out",
                str(a.out),
                "--steps",
                str(a.steps),
            ],
            capture_output=True,
            text=True,
            timeout=a.timeout,
            env=env,
            cwd=HERE,
        )
        if dit.returncode != 0:
            print(dit.stdout + dit.stderr, file=sys.stderr)
            return 1
        res = json.loads([x for x in dit.stdout.splitlines() if x.startswith("RESULT ")][-1][7:])
        print(
            f"diffusion stage (no vLLM imported: {not res['vllm_imported']}) received KV for "
            f"{res['layers']} layers x {res['prompt_tokens']} tokens x {res['kv_heads']} heads x "
            f"{res['head_dim']} in {res['total_recv_ms']:.1f} ms (negative prompt: "
            f"{res['negative_tokens']} tokens, {res['negative_recv_ms']:.1f} ms)"
        )
        print(f"denoised {a.steps} steps with CFG in {res['denoise_ms']:.0f} ms -> {res['png']}")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    except Exception as e:
        print(f"\nFAILED: {e} (AR stage log: {a.out.with_suffix('.ar.log')})", file=sys.stderr)
        return 1
    finally:
        if ar.poll() is None:
            try:
                assert ar.stdin is not None
                ar.stdin.write("done\n")
                ar.stdin.flush()
                ar.wait(60)
            except Exception:
                ar.kill()
                ar.wait(10)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
