"""Benchmark results: each benchmark's ``--json PATH`` record, and ``RESULTS.md`` made from them.

A benchmark calls ``add_json_argument(parser)`` and, once its arguments are parsed,
``record(args.json, __file__)``: from then on what it prints also goes to a buffer, and at exit
(rank 0 only, under MPI) the buffer is written to PATH as JSON together with the command that
produced it, the machine and the date. ``benchmarks/results/<benchmark>.json`` holds the latest
record of each benchmark; ``python benchmarks/results.py`` turns them into
``benchmarks/RESULTS.md``, so no figure in it is typed by hand. The historical record (earlier
runs, with their dates and machines) is ``benchmarks/results/HISTORY.md``, appended as it is.

    .venv/bin/python benchmarks/reshard.py --json benchmarks/results/reshard.json
    .venv/bin/python benchmarks/results.py            # rewrite benchmarks/RESULTS.md
    .venv/bin/python benchmarks/results.py --check    # exit 1 if RESULTS.md is stale
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import io
import json
import os
import platform
import sys
from typing import Any, TextIO

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
HISTORY_MD = os.path.join(RESULTS_DIR, "HISTORY.md")
FORMAT = "mpipar.benchmark-result"
MAX_RECORD_BYTES = 1 << 20
"""A record is a benchmark's printed output: larger files are refused, not rendered."""
FIELDS = ("benchmark", "command", "machine", "date", "output")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--json PATH`` flag every benchmark takes."""
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write this run's output, command, machine and date to PATH as JSON "
        "(benchmarks/results/<benchmark>.json; benchmarks/results.py makes RESULTS.md of them)",
    )


def _rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def machine() -> str:
    """The machine in words: CPU model and count, OS, Python and NumPy versions, the load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy

    text = (
        f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, NumPy {numpy.__version__}"
    )
    if hasattr(os, "getloadavg"):  # other jobs' load moves every timing on a shared machine
        text += f", load average {os.getloadavg()[0]:.1f} at the end"
    return text


class _Tee(io.TextIOBase):
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.buffer_text = io.StringIO()

    def write(self, text: str) -> int:
        self.buffer_text.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()


def record(path: str | None, script: str) -> None:
    """From now on, keep what this process prints; at exit write it to ``path`` (rank 0 only)."""
    if not path or _rank() != 0:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise SystemExit(f"--json: {directory} is not a directory")
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    argv = list(sys.argv[1:])
    if "--json" in argv:
        i = argv.index("--json")
        del argv[i : i + 2]
    argv = [a for a in argv if not a.startswith("--json=")]
    name = os.path.splitext(os.path.basename(script))[0]
    command = " ".join(["python", f"benchmarks/{name}.py", *argv])
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        command = f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} {command}"

    def write() -> None:
        sys.stdout.flush()
        data = {
            "format": FORMAT,
            "benchmark": name,
            "command": command,
            "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "output": tee.buffer_text.getvalue(),
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")

    atexit.register(write)


def load_record(path: str) -> dict[str, str]:
    """One ``--json`` record, checked: a bounded JSON object of the expected string fields."""
    if os.path.getsize(path) > MAX_RECORD_BYTES:
        raise ValueError(f"{path}: over {MAX_RECORD_BYTES} bytes")
    with open(path, encoding="utf-8") as f:
        data: Any = json.load(f)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} record")
    for field in FIELDS:
        if not isinstance(data.get(field), str):
            raise ValueError(f"{path}: field {field!r} must be a string, got {data.get(field)!r:.80}")
    return {field: data[field] for field in FIELDS}


def _fence(text: str) -> str:
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return f"{ticks}text\n{text.rstrip()}\n{ticks}"


def render() -> str:
    records = []
    if os.path.isdir(RESULTS_DIR):
        for name in sorted(os.listdir(RESULTS_DIR)):
            if name.endswith(".json"):
                records.append(load_record(os.path.join(RESULTS_DIR, name)))
    out = [
        "# Benchmark results",
        "",
        "<!-- Generated by benchmarks/results.py from benchmarks/results/*.json; do not edit by hand. -->",
        "",
        "Each benchmark's latest run: the command, the machine, the date and what it printed. A",
        "benchmark writes its record with `--json benchmarks/results/<benchmark>.json`;",
        "`python benchmarks/results.py` regenerates this page. Timings on a shared machine move",
        "with its load: the benchmarks report ratios against a baseline run in the same process.",
        "What each benchmark measures is on the documentation's Performance page.",
        "",
        "## Latest runs",
        "",
        "| benchmark | date | machine | command |",
        "|---|---|---|---|",
    ]
    for r in records:
        cells = [
            f"[{r['benchmark']}](#{r['benchmark'].replace('_', '-')})",
            r["date"],
            r["machine"],
            f"`{r['command']}`",
        ]
        out.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    for r in records:
        out += [
            "",
            f"### {r['benchmark'].replace('_', '-')}",
            "",
            f"`{r['command']}` on {r['machine']}, {r['date']}:",
            "",
            _fence(r["output"]),
        ]
    if os.path.exists(HISTORY_MD):
        with open(HISTORY_MD, encoding="utf-8") as f:
            out += ["", f.read().rstrip()]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
    from generated import write_or_check

    return write_or_check(RESULTS_MD, render, "Write benchmarks/RESULTS.md from benchmarks/results/*.json.", argv)


if __name__ == "__main__":
    sys.exit(main())
