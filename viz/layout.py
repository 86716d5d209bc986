"""Layout view: a tensor's global extent as tiles proportional to its shards, and the mesh beside it.

    blocks = layout_blocks(spec)                         # distinct boxes, their ranks, colours
    tensor_tiles_figure(spec, dims=(0, 1), at=(0, 0, 0)) # the two tensor dims shown
    mesh_grid_figure(spec, itemsize=4)                   # what each rank holds
    print(layout_text(spec, "fc1.weight", itemsize=4))   # the same as a text grid

A *block* is one distinct box of the tensor (``DistSpec.cells``): ranks holding the same box
hold replicas (over Replicate axes) or partial values (over Partial axes: the block's value
is their reduction). Tiles are a block's extent in the two chosen tensor dims, so uneven shards
show as unequal tiles; a block that is empty on some dim (a dim smaller than its mesh axis) has
no area and is listed beside the picture. For tensors of more than two dims the other dims are
fixed at ``at`` (default 0): the picture is that 2-D slice, and only blocks containing it show.
A block of a zigzag (load-balanced) split holds two separate chunks of its dim: it is drawn as
two tiles of one colour, and its box is written as their union (``[0,2)+[6,8)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mpipar.mesh import ProcessMesh
from mpipar.placement import Partial, Replicate, ZigzagShard
from mpipar.spec import Box, DistSpec, box_numel, box_shape
from viz.figures import MAX_LABELS, block_color, block_name, new_figure
from viz.planinfo import fmt_bytes, fmt_ranks


@dataclass(frozen=True)
class Block:
    index: int
    box: Box
    ranks: tuple[int, ...]

    @property
    def name(self) -> str:
        return block_name(self.index)

    @property
    def color(self) -> str:
        return block_color(self.index)

    @property
    def empty(self) -> bool:
        return box_numel(self.box) == 0


def global_boxes(spec: DistSpec, box: Box) -> list[Box]:
    """The global boxes a (storage-order) box holds: itself, or a zigzag split's chunks."""
    return [g for _, g in spec.global_pieces(box)] if spec.zigzag else [box]


def box_text(spec: DistSpec, box: Box) -> str:
    """``[0,4) x [0,2)+[6,8)``: each dim's global range(s)."""
    if not box:
        return "scalar"
    pieces = global_boxes(spec, box)
    dims = []
    for d in range(len(box)):
        ranges = list(dict.fromkeys(g[d] for g in pieces))
        dims.append("+".join(f"[{s},{e})" for s, e in ranges))
    return " x ".join(dims)


def layout_blocks(spec: DistSpec) -> list[Block]:
    """The distinct boxes of ``spec`` in mesh order, with the ranks holding each."""
    return [Block(i, box, ranks) for i, (box, ranks) in enumerate(spec.cells.items())]


def replication(spec: DistSpec) -> tuple[int, int]:
    """(replicas, partial holders) of every block: products of the Replicate / Partial axis sizes."""
    rep = part = 1
    for a, p in enumerate(spec.placements):
        if isinstance(p, Replicate):
            rep *= spec.mesh.shape[a]
        elif isinstance(p, Partial):
            part *= spec.mesh.shape[a]
    return rep, part


def default_dims(spec: DistSpec) -> tuple[int, ...]:
    """The two dims to show first: the sharded ones if any, else the last two."""
    nd = len(spec.shape)
    if nd <= 2:
        return tuple(range(nd))
    sharded = [d for d in range(nd) if spec.shard_axes(d)]
    chosen = (sharded + [d for d in range(nd - 1, -1, -1) if d not in sharded])[:2]
    return tuple(sorted(chosen))


def _check_dims(
    spec: DistSpec, dims: Sequence[int], at: Sequence[int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    nd = len(spec.shape)
    dims = tuple(int(d) for d in dims)
    if len(dims) != min(nd, 2) or len(set(dims)) != len(dims) or any(not 0 <= d < nd for d in dims):
        raise ValueError(
            f"layout dims {list(dims)} of a {nd}-d tensor {list(spec.shape)}: pick {min(nd, 2)} distinct dims in 0..{nd - 1}"
        )
    at_t = tuple(int(i) for i in at) if at is not None else (0,) * nd
    if len(at_t) != nd:
        raise ValueError(f"layout position {list(at_t)} needs one index per tensor dim ({nd})")
    for d in range(nd):
        if d not in dims and spec.shape[d] and not 0 <= at_t[d] < spec.shape[d]:
            raise ValueError(f"layout position {at_t[d]} on dim {d} is outside its size {spec.shape[d]}")
    return dims, at_t


def visible_blocks(spec: DistSpec, dims: Sequence[int], at: Sequence[int] | None = None) -> list[Block]:
    """Blocks with area in the 2-D slice shown (non-empty on the shown dims, containing ``at`` elsewhere)."""
    dims, at_t = _check_dims(spec, dims, at)
    out = []
    for b in layout_blocks(spec):
        if b.empty:
            continue
        if any(
            all(d in dims or g[d][0] <= at_t[d] < g[d][1] for d in range(len(spec.shape)))
            for g in global_boxes(spec, b.box)
        ):
            out.append(b)
    return out


def _extent(box: Box, dims: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, cols) of a box in the shown dims; a 1-d tensor is one row, a 0-d one cell."""
    if len(dims) == 2:
        return box[dims[0]], box[dims[1]]
    if len(dims) == 1:
        return (0, 1), box[dims[0]]
    return (0, 1), (0, 1)


def _title(spec: DistSpec, name: str) -> str:
    mesh = ",".join(f"{n}={s}" for n, s in zip(spec.mesh.dim_names, spec.mesh.shape, strict=True))
    return f"{name} {list(spec.shape)} on mesh[{mesh}]: {spec.placements_str}"


def _zigzag_note(spec: DistSpec) -> str:
    parts = [f"{p} on {spec.mesh.dim_names[a]}" for a, p in enumerate(spec.placements) if isinstance(p, ZigzagShard)]
    if not parts:
        return ""
    return "Zigzag: " + ", ".join(parts) + " (load-balanced: rank r of k holds chunks r and 2k-1-r of 2k)"


def _partial_note(spec: DistSpec) -> str:
    parts = [f"{p} on {spec.mesh.dim_names[a]}" for a, p in enumerate(spec.placements) if isinstance(p, Partial)]
    if not parts:
        return ""
    return "Partial: " + ", ".join(parts) + " (hatched: each block's value is the reduction of its holders)"


def tensor_tiles_figure(
    spec: DistSpec, name: str = "tensor", dims: Sequence[int] | None = None, at: Sequence[int] | None = None
) -> Figure:
    """The global tensor as tiles (one per visible block), coloured by block, Partial hatched."""
    dims_t, at_t = _check_dims(spec, default_dims(spec) if dims is None else dims, at)
    blocks = visible_blocks(spec, dims_t, at_t)
    nrows = spec.shape[dims_t[0]] if len(dims_t) == 2 else 1
    ncols = spec.shape[dims_t[-1]] if dims_t else 1
    ratio = min(max(nrows / max(ncols, 1), 0.25), 1.5)
    fig = new_figure(6.4, 1.6 + 4.4 * ratio)
    ax = fig.add_subplot()
    partial = bool(spec.partial_axes)
    # One collection for every tile keeps the artist count flat however many blocks there are.
    rects, colors = [], []
    for b in blocks:
        for g in global_boxes(spec, b.box):
            (r0, r1), (c0, c1) = _extent(g, dims_t)
            rects.append(Rectangle((c0, r0), c1 - c0, r1 - r0))
            colors.append(b.color)
    if rects:
        ax.add_collection(
            PatchCollection(
                rects, facecolors=colors, edgecolors="white", linewidths=1.5, hatch="//" if partial else None
            )
        )
    if len(blocks) <= MAX_LABELS:
        for blk, g in ((b, g) for b in blocks for g in global_boxes(spec, b.box)):
            (r0, r1), (c0, c1) = _extent(g, dims_t)
            label = f"{blk.name}\n{'x'.join(str(n) for n in box_shape(g)) or 'scalar'}\nr{fmt_ranks(blk.ranks, 3)}"
            ax.text(
                (c0 + c1) / 2,
                (r0 + r1) / 2,
                label,
                ha="center",
                va="center",
                fontsize=8,
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1},
            )
    ax.set_xlim(0, max(ncols, 1))
    ax.set_ylim(max(nrows, 1), 0)
    ax.set_xlabel(f"dim {dims_t[-1]} (size {spec.shape[dims_t[-1]]})" if dims_t else "scalar")
    if not dims_t:
        ax.set_xticks([])
    ax.set_ylabel(f"dim {dims_t[0]} (size {spec.shape[dims_t[0]]})" if len(dims_t) == 2 else "")
    if len(dims_t) < 2:
        ax.set_yticks([])
    notes = []
    hidden = [d for d in range(len(spec.shape)) if d not in dims_t]
    if hidden:
        notes.append("slice at " + ", ".join(f"dim {d} = {at_t[d]}" for d in hidden))
    empty = [b for b in layout_blocks(spec) if b.empty]
    if empty:
        ranks = sorted(r for b in empty for r in b.ranks)
        notes.append(f"empty shards on ranks {fmt_ranks(ranks, 8)}")
    if partial:
        notes.append(_partial_note(spec))
    if _zigzag_note(spec):
        notes.append(_zigzag_note(spec))
    ax.set_title(_title(spec, name) + ("\n" + "\n".join(notes) if notes else ""), fontsize=9)
    return fig


def _mesh_rows(mesh: ProcessMesh) -> tuple[np.ndarray, list[str], list[str]]:
    """The mesh as a 2-D id array (leading axes folded into rows) with row and column labels."""
    ids = np.asarray(mesh.mesh)
    names = mesh.dim_names
    if ids.ndim == 1:
        return ids.reshape(1, -1), [""], [f"{names[0]}={i}" for i in range(ids.shape[0])]
    lead = ids.shape[:-1]
    rows = [",".join(f"{n}={c}" for n, c in zip(names[:-1], idx, strict=True)) for idx in np.ndindex(*lead)]
    return ids.reshape(-1, ids.shape[-1]), rows, [f"{names[-1]}={i}" for i in range(ids.shape[-1])]


def rank_table(spec: DistSpec, itemsize: int) -> list[dict[str, object]]:
    """One row per rank: coordinate, block, box, local shape, bytes, replicas / partial holders."""
    block_of = {r: b for b in layout_blocks(spec) for r in b.ranks}
    _, part = replication(spec)
    rows = []
    for r in spec.mesh.process_ids:
        b = block_of[r]
        box = b.box
        rows.append(
            {
                "rank": r,
                "coord": spec.mesh.coordinate(r),
                "block": b.name,
                "box": box_text(spec, box),
                "local shape": box_shape(box),
                "bytes": box_numel(box) * itemsize,
                "replicas": len(b.ranks) // part if part > 1 else len(b.ranks),
                "partial holders": part,
                "empty": box_numel(box) == 0 and len(spec.shape) > 0,
            }
        )
    return rows


def draw_mesh_grid(
    ax: Any,
    mesh: ProcessMesh,
    colors: Mapping[int, str],
    texts: Mapping[int, str] | None = None,
    edges: Mapping[int, str] | None = None,
) -> None:
    """Draw ``mesh`` on ``ax``: one cell per rank in ``colors[rank]``, ``texts`` when few cells.

    ``edges`` outlines cells (a collective's groups); one collection per concern, so the artist
    count does not grow with the mesh.
    """
    grid, row_labels, col_labels = _mesh_rows(mesh)
    nr, nc = grid.shape
    rects, facecolors, edgecolors = [], [], []
    for i in range(nr):
        for j in range(nc):
            r = int(grid[i, j])
            rects.append(Rectangle((j, i), 1, 1))
            facecolors.append(colors.get(r, "#DDDDDD"))
            edgecolors.append((edges or {}).get(r, "white"))
    ax.add_collection(
        PatchCollection(rects, facecolors=facecolors, edgecolors=edgecolors, linewidths=2.5 if edges else 1.0)
    )
    if texts is not None and nr * nc <= MAX_LABELS:
        for i in range(nr):
            for j in range(nc):
                text = texts.get(int(grid[i, j]))
                if text:
                    ax.text(
                        j + 0.5,
                        i + 0.5,
                        text,
                        ha="center",
                        va="center",
                        fontsize=7,
                        bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1},
                    )
    ax.set_xlim(0, nc)
    ax.set_ylim(nr, 0)
    step_c = max(1, nc // 16)
    step_r = max(1, nr // 16)
    ax.set_xticks([j + 0.5 for j in range(0, nc, step_c)], [col_labels[j] for j in range(0, nc, step_c)], fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(0, nr, step_r)], [row_labels[i] for i in range(0, nr, step_r)], fontsize=7)
    ax.tick_params(length=0)


def mesh_grid_figure(spec: DistSpec, itemsize: int = 4, name: str = "tensor") -> Figure:
    """The mesh as a grid: each rank's cell in its block's colour with local shape, bytes, replicas."""
    grid, _, _ = _mesh_rows(spec.mesh)
    rows = {row["rank"]: row for row in rank_table(spec, itemsize)}
    block_index = {r: b.index for b in layout_blocks(spec) for r in b.ranks}
    nr, nc = grid.shape
    fig = new_figure(min(2.0 + 1.5 * nc, 12.0), min(1.4 + 0.9 * nr, 10.0))
    ax = fig.add_subplot()
    colors = {r: "#DDDDDD" if rows[r]["empty"] else block_color(block_index[r]) for r in rows}
    texts = {}
    for r, row in rows.items():
        shape = "x".join(str(n) for n in row["local shape"]) or "scalar"  # type: ignore[attr-defined]
        rep = f"x{row['replicas']} repl" if row["replicas"] != 1 else "1 copy"
        if int(row["partial holders"]) > 1:  # type: ignore[call-overload]
            rep += f", 1/{row['partial holders']} partial"
        texts[r] = (
            f"rank {r}  {row['block']}\n{'empty' if row['empty'] else shape}\n{fmt_bytes(float(row['bytes']))}\n{rep}"  # type: ignore[arg-type]
        )
    draw_mesh_grid(ax, spec.mesh, colors, texts)
    sizes = sorted({int(r["bytes"]) for r in rows.values()})  # type: ignore[call-overload]
    span = fmt_bytes(sizes[0]) if len(sizes) == 1 else f"{fmt_bytes(sizes[0])} .. {fmt_bytes(sizes[-1])}"
    ax.set_title(f"{name} per rank ({len(rows)} ranks; local bytes {span})", fontsize=9)
    return fig


def layout_text(
    spec: DistSpec,
    name: str = "tensor",
    itemsize: int = 4,
    dims: Sequence[int] | None = None,
    at: Sequence[int] | None = None,
    max_ranks: int = 64,
) -> str:
    """The layout as text: blocks with their boxes and holders, then the mesh grid of block names."""
    dims_t, at_t = _check_dims(spec, default_dims(spec) if dims is None else dims, at)
    blocks = layout_blocks(spec)
    rep, part = replication(spec)
    lines = [_title(spec, name)]
    for note in (_partial_note(spec), _zigzag_note(spec)):
        if note:
            lines.append(note)
    lines.append(
        f"blocks: {len(blocks)}; each held by {rep} replica(s)" + (f" x {part} partial holders" if part > 1 else "")
    )
    shown = blocks[:max_ranks]
    for b in shown:
        box = box_text(spec, b.box)
        shape = "x".join(str(n) for n in box_shape(b.box)) or "scalar"
        tag = "  EMPTY" if b.empty and spec.shape else ""
        lines.append(
            f"  {b.name:>3} {box:<28} {shape:<12} {fmt_bytes(box_numel(b.box) * itemsize):>10}  ranks {fmt_ranks(b.ranks)}{tag}"
        )
    if len(blocks) > len(shown):
        lines.append(f"  ... {len(blocks) - len(shown)} more blocks")
    grid, row_labels, col_labels = _mesh_rows(spec.mesh)
    block_of = {r: b.name for b in blocks for r in b.ranks}
    nr, nc = grid.shape
    cols = min(nc, 16)
    rows = min(nr, 32)
    width = max([len(c) for c in col_labels[:cols]] + [8])
    label_w = max([len(r) for r in row_labels[:rows]] + [4])
    lines.append("mesh (rank:block):")
    lines.append(
        " " * (label_w + 2) + "  ".join(c.ljust(width) for c in col_labels[:cols]) + ("  ..." if nc > cols else "")
    )
    for i in range(rows):
        cells = "  ".join(f"{int(grid[i, j])}:{block_of[int(grid[i, j])]}".ljust(width) for j in range(cols))
        lines.append(f"{row_labels[i]:<{label_w}}  {cells}".rstrip() + ("  ..." if nc > cols else ""))
    if nr > rows:
        lines.append(f"... {nr - rows} more rows")
    hidden = [d for d in range(len(spec.shape)) if d not in dims_t]
    if hidden:
        lines.append(
            "2-D view: dims "
            + " x ".join(str(d) for d in dims_t)
            + "; slice at "
            + ", ".join(f"dim {d} = {at_t[d]}" for d in hidden)
        )
    return "\n".join(lines) + "\n"
