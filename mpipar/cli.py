"""The ``mpipar`` command.

mpipar reshard --shape 8 6 --mesh 2x2 --src "S(0)S(1)" --dst "S(1)S(0)" [--dst-mesh 4:4,5,6,7]
mpipar info
mpipar plan SCRIPT [args] -o plan.json [-n 8 | --shape-only]
mpipar viz plan.json [timeline.json] [--address 127.0.0.1] [--port 8501]
mpipar viz [--launcher mpiexec] [--prepare-only] --run examples/gpt.py --mesh dp=2,tp=2 --tiny
mpipar launch -n 4 [--simulate] [--hosts h1:2,h2:2] [--log-dir logs] [--max-restarts K] -- train.py args
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from mpipar import cliargs, launch
from mpipar.backend import create_backend, current_backend
from mpipar.compile.plan_script import trace_script
from mpipar.mesh import ProcessMesh
from mpipar.placement import parse_placements
from mpipar.reshard import plan_reshard
from mpipar.spec import DistSpec
from mpipar.untrusted import printable
from mpipar.version import __version__


def _parse_mesh(text: str, names: str | None, flag: str, max_world: int) -> object:
    """``2x2`` (ids 0..3), ``2x2:4,5,6,7`` (explicit ids) or ``4`` ."""
    dims_part, _, ids_part = text.partition(":")
    try:
        dims = [int(x) for x in dims_part.lower().split("x")]
    except ValueError:
        raise ValueError(f"{flag}: cannot read mesh {text!r}; write e.g. 2x2 or 2x2:4,5,6,7") from None
    if any(d < 1 for d in dims):
        raise ValueError(f"{flag}: mesh {text!r} has a dimension below 1")
    count = cliargs.check_world(dims, flag, max_world)  # before any array of that size exists
    try:
        ids = [int(x) for x in ids_part.split(",")] if ids_part else list(range(count))
    except ValueError:
        raise ValueError(f"{flag}: cannot read the ids of mesh {text!r}; write e.g. 2x2:4,5,6,7") from None
    if len(ids) != count:
        raise ValueError(f"{flag}: mesh {text!r} has {count} positions but {len(ids)} ids")
    dim_names = names.split(",") if names else None
    return ProcessMesh(np.array(ids).reshape(dims), dim_names=dim_names)


def _cmd_reshard(ns: argparse.Namespace) -> int:
    src_mesh = _parse_mesh(ns.mesh, ns.names, "--mesh", ns.max_world)
    dst_mesh = _parse_mesh(ns.dst_mesh, ns.names, "--dst-mesh", ns.max_world) if ns.dst_mesh else src_mesh
    src = DistSpec(ns.shape, src_mesh, parse_placements(ns.src))  # type: ignore[arg-type]
    dst = DistSpec(ns.shape, dst_mesh, parse_placements(ns.dst))  # type: ignore[arg-type]
    itemsize = np.dtype(ns.dtype).itemsize
    plan = plan_reshard(src, dst)
    print(plan.format(itemsize))
    total = plan.bytes_per_rank(itemsize)
    tensor_bytes = src.numel * itemsize
    ratio = f" ({total / tensor_bytes:.3f} x tensor)" if tensor_bytes else ""
    print(f"bytes received per rank: {total:g}{ratio}")
    return 0


def _cmd_info(ns: argparse.Namespace) -> int:
    print(f"mpipar {__version__}, backend: {current_backend().describe()}")
    return 0


def _cmd_plan(ns: argparse.Namespace) -> int:
    backend = create_backend("shape-only" if ns.shape_only else "sim", world_size=ns.nprocs)
    plan = trace_script(ns.script, ns.args, backend, {"world_size": ns.nprocs, "shape_only": ns.shape_only})
    try:
        plan.save(ns.output)
    except OSError as exc:
        return cliargs.write_failure("mpipar plan", ns.output, exc)
    print(printable(plan.summary(), keep_newlines=True))
    print(f"wrote {printable(ns.output)}")
    return 0


def _cmd_viz(ns: argparse.Namespace) -> int:
    import subprocess

    # The dashboard is another package (viz -> simulator -> mpipar): run it, never import it.
    # (viz.__main__ prints the warning for an address other machines can reach.)
    args = [*ns.files, "--address", ns.address] + (["--port", str(ns.port)] if ns.port is not None else [])
    if ns.run is not None:  # viz.__main__ checks these; --run and the script's own arguments go last
        args += ["--run-dir", ns.run_dir, "--steps", str(ns.steps), "--launcher", ns.launcher]
        args += (["--shape-only"] if ns.shape_only else []) + (["--prepare-only"] if ns.prepare_only else [])
        args += ["--run", *ns.run]
    try:
        return subprocess.call([sys.executable, "-m", "viz", *args])
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # its own parser: everything after the script is the script's
        return launch.main(argv[1:])
    parser = cliargs.Parser(prog="mpipar", description="mpipar tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "launch",
        help="run a script on N ranks (mpiexec or --simulate) with per-rank logs, heartbeats and restarts "
        "(mpipar launch -h)",
    )
    p = sub.add_parser("reshard", help="print the plan that reshards a tensor between two layouts")
    p.add_argument(
        "--shape",
        type=cliargs.int_range(0, 1 << 62, "a dim size"),
        nargs="+",
        required=True,
        help="global tensor shape",
    )
    p.add_argument("--mesh", required=True, help="source mesh: 2x2, or 2x2:0,1,2,3 with ids")
    p.add_argument("--dst-mesh", default=None, help="destination mesh when it differs")
    p.add_argument("--names", default=None, help="axis names, comma separated")
    p.add_argument("--src", required=True, help='source placements, e.g. "S(0)S(1)"')
    p.add_argument("--dst", required=True, help='destination placements, e.g. "RR"')
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--max-world",
        type=cliargs.positive_int,
        default=cliargs.MAX_WORLD,
        help=f"refuse meshes of more ranks (default {cliargs.MAX_WORLD})",
    )
    p.set_defaults(func=_cmd_reshard)
    p = sub.add_parser("info", help="print the version and the backend this process would use")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("plan", help="trace a training script's first step into a plan (JSON) without training")
    p.add_argument("-o", "--output", required=True, type=cliargs.output_path, help="where to write the plan")
    p.add_argument(
        "-n",
        "--nprocs",
        type=cliargs.int_range(1, cliargs.MAX_WORLD, "a world size"),
        default=None,
        help="virtual world size (default: grows with the meshes)",
    )
    p.add_argument("--shape-only", action="store_true", help="shapes and layouts only: no values are computed")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_plan)
    p = sub.add_parser("viz", help="open plans and timelines in the dashboard (Streamlit, on 127.0.0.1)")
    p.add_argument("files", nargs="*", help="plan.json, then optional timeline.json (and a measured one)")
    p.add_argument("--address", default="127.0.0.1", help="address to bind; default: this machine only")
    p.add_argument("--port", type=cliargs.port, default=None)
    p.add_argument("--run-dir", default="mpipar-run", help="with --run: where its files go (default ./mpipar-run/)")
    p.add_argument(
        "--steps",
        type=cliargs.int_range(1, 10_000, "a step count"),
        default=3,
        help="with --run: measured training steps (unless the script's arguments give --steps)",
    )
    p.add_argument("--launcher", choices=["sim", "mpiexec"], default="sim", help="with --run: simulator or mpiexec")
    p.add_argument("--shape-only", action="store_true", help="with --run: trace the plan shape-only")
    p.add_argument("--prepare-only", action="store_true", help="with --run: write the files, start no server")
    p.add_argument(
        "--run",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT ARGS",
        help="trace SCRIPT's plan, run a few measured steps (MPIPAR_TRACE), open both (last option)",
    )
    p.set_defaults(func=_cmd_viz)
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns))
    except (ValueError, TypeError) as exc:
        print(f"mpipar {ns.cmd}: {printable(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
