"""examples/llama.py on one GPU (the NCCL backend): step time, model FLOP/s and MFU at sizes that
fill the device, fused against plain attention.

Each size runs ``mpiexec -n 1 python examples/llama.py`` with its shape flags and
``MPIPAR_BACKEND=nccl``; the step time is the p50 of the steps after the warm-up (the run's own
closing spread line), the parameter count the run's header. Model FLOPs per token are
``6 N + 6 L S H``: the six multiply-adds per parameter of a forward and backward, and the
attention scores' ``12 L S H`` halved for the causal mask (Narayanan et al. 2021 count the whole
matrix; the causal half is what a fused kernel computes). MFU is against the device's
float32 peak without tensor cores (CuPy multiplies float32 without TF32 unless ``CUPY_TF32=1``);
``--peak-tflops`` sets another. Peak memory is sampled from ``nvidia-smi`` while each run lasts.

    MPIPAR_BACKEND=nccl python benchmarks/gpu_llama.py --json benchmarks/results/gpu_llama.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from results import add_json_argument, record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES: dict[str, list[str]] = {
    "A": [
        "--hidden",
        "2048",
        "--layers",
        "8",
        "--heads",
        "16",
        "--kv-heads",
        "4",
        "--ffn-hidden",
        "5632",
        "--seq-len",
        "1024",
        "--batch-size",
        "16",
    ],
    "B": [
        "--hidden",
        "4096",
        "--layers",
        "8",
        "--heads",
        "32",
        "--kv-heads",
        "8",
        "--ffn-hidden",
        "14336",
        "--seq-len",
        "2048",
        "--batch-size",
        "8",
    ],
}
"""A: a 0.36B-parameter Llama (16,384 tokens a step); B: eight layers of Llama 3 8B's shape
(1.75B parameters, sequence 2048), which fills most of an H200's 141 GB."""

FP32_PEAK_TFLOPS = {"H200": 67.0, "H100": 67.0, "A100": 19.5}
"""Vendor float32 (CUDA-core, dense) peaks: NVIDIA's H100/H200 SXM and A100 datasheets."""


def flag(args: list[str], name: str) -> int:
    return int(args[args.index(name) + 1])


def flops_per_token(params: int, size: list[str]) -> float:
    layers, seq, hidden = flag(size, "--layers"), flag(size, "--seq-len"), flag(size, "--hidden")
    return 6.0 * params + 6.0 * layers * seq * hidden


class MemorySampler:
    """The largest ``memory.used`` nvidia-smi reports while the block runs (MiB), or None."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        smi = shutil.which("nvidia-smi")
        while smi and not self._stop.is_set():
            out = subprocess.run(
                [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            for line in out.stdout.split():
                if line.strip().isdigit():
                    self.peak = max(self.peak or 0, int(line))
            self._stop.wait(0.5)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_size(name: str, attention: str, steps: int, timeout: float, peak_tflops: float) -> str:
    size = SIZES[name]
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec, "-n", "1", sys.executable, os.path.join(REPO, "examples", "llama.py"), *size]
    cmd += ["--steps", str(steps), "--sample", "0", "--attention", attention]
    env = {**os.environ, "MPIPAR_BACKEND": os.environ.get("MPIPAR_BACKEND", "nccl")}
    start = time.perf_counter()
    with MemorySampler() as memory:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL, cwd=REPO
        )
    wall = time.perf_counter() - start
    text = out.stdout + out.stderr
    if out.returncode != 0:
        return f"{name} {attention}: failed (exit {out.returncode}) after {wall:.0f} s: {text[-400:]!r}"
    params = int(re.search(r"Llama: ([\d,]+) parameters", text)[1].replace(",", ""))
    tokens = flag(size, "--batch-size") * flag(size, "--seq-len")
    p50 = float(re.search(r"p50 ([\d.]+) ms, p90", text)[1]) / 1e3
    spread = re.search(r"p90/p50 ([\d.]+)", text)[1]
    rate = tokens / p50
    tflops = flops_per_token(params, size) * rate / 1e12
    last = re.findall(r"^step (\d+) loss (\S+)$", out.stdout, re.M)[-1]
    mem = "n/a" if memory.peak is None else f"{memory.peak / 1024:.1f} GiB"
    return (
        f"{name} {attention:5s}: {params / 1e9:.2f}B params, {tokens:,} tokens/step, p50 {p50 * 1e3:.0f} ms/step "
        f"(p90/p50 {spread}), {rate:,.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {100 * tflops / peak_tflops:.0f}% "
        f"of {peak_tflops:g} TFLOP/s float32, peak memory {mem}, step {last[0]} loss {last[1]}"
    )


def device_name() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise SystemExit("gpu_llama.py needs an NVIDIA GPU (nvidia-smi not found)")
    out = subprocess.run(
        [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip().splitlines()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="A,B", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--steps", type=int, default=6, help="steps per run (two are warm-up)")
    p.add_argument("--plain", default="A", help="sizes also run with plain attention (comma-separated)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the peak MFU is against (default: float32)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    add_json_argument(p)
    args = p.parse_args()
    record(args.json, __file__)
    device = device_name()
    peak = args.peak_tflops or next((v for k, v in FP32_PEAK_TFLOPS.items() if k in device), None)
    if peak is None:
        raise SystemExit(f"no float32 peak known for {device!r}: pass --peak-tflops")
    print(f"device: {device}")
    for name in [s for s in args.sizes.split(",") if s]:
        if name not in SIZES:
            raise SystemExit(f"--sizes: unknown size {name!r}; known: {', '.join(SIZES)}")
        print(run_size(name, "fused", args.steps, args.timeout, peak), flush=True)
        if name in args.plain.split(","):
            print(run_size(name, "plain", args.steps, args.timeout, peak), flush=True)


if __name__ == "__main__":
    main()
