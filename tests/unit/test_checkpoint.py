"""Distributed checkpoints in the simulator: any layout saved, any layout loaded, bit for bit.

The oracle is plain NumPy: ``strategies.make_tensor`` builds a tensor with a known global
value (genuinely partial shards included) and ``strategies.global_value`` rebuilds the value
of a loaded tensor from its shards without the library. Worlds of other sizes are other
``SimBackend(n)`` instances: a mesh there cannot name a rank >= n.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_checkpoint.py``
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import gpt_training_state
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import global_value, make_tensor, meshes, placements_for, tensor_shapes

import mpipar as dist
from mpipar.checkpoint import CheckpointError, read_state_dict, record_io
from mpipar.checkpoint.format import MARKER, METADATA
from mpipar.spec import box_intersect
from simulator import ReferenceBackend, SimBackend


def _meta(ck: str) -> dict[str, Any]:
    with open(os.path.join(ck, METADATA)) as f:
        return json.load(f)


def identical(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaNs and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ================================================================== property: any -> any
@settings(max_examples=120)
@given(
    st.data(),
    tensor_shapes,
    st.integers(0, 2**31 - 1),
    st.sampled_from([1, 2, 3, 4, 8, 16]),
    st.sampled_from([8, 40, 1 << 20]),
)
def test_round_trip_any_layout_any_world(
    data: st.DataObject, shape: list[int], seed: int, world: int, piece_bytes: int
) -> None:
    """Saved under a drawn layout (uneven, Partial) on up to 16 ranks; loaded under another
    mesh, placements and world size (1 and 3 included), or into a dense tensor."""
    src_mesh = data.draw(meshes())
    src = dist.DistSpec(shape, src_mesh, data.draw(placements_for(src_mesh, len(shape))))
    t, expected = make_tensor(src, seed)
    dense_target = data.draw(st.booleans())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ck")
        dist.save_state_dict({"t": t}, path, piece_bytes=piece_bytes)
        with dist.use_backend(SimBackend(world)):
            if dense_target:
                out = dist.to_tensor(np.full(shape, -1.0))
            else:
                mesh = data.draw(meshes(max_ranks=world, id_pool=world))
                out = dist.shard_tensor(np.full(shape, -1.0), mesh, data.draw(placements_for(mesh, len(shape))))
            before = id(out)
            dist.load_state_dict({"t": out}, path)
            assert id(out) == before
            got = out.full_tensor() if dense_target else global_value(out)
    if src.is_partial or (not dense_target and out.spec.is_partial):
        # The saved value is the reduced one; the oracle reduces in another order.
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    else:
        assert identical(got, expected)


@settings(max_examples=40)
@given(st.data(), tensor_shapes, st.integers(0, 2**31 - 1))
def test_replicas_written_once_and_partials_stored_sharded(data: st.DataObject, shape: list[int], seed: int) -> None:
    mesh = data.draw(meshes())
    spec = dist.DistSpec(shape, mesh, data.draw(placements_for(mesh, len(shape))))
    t, expected = make_tensor(spec, seed)
    with tempfile.TemporaryDirectory() as tmp:
        dist.save_state_dict({"t": t}, tmp + "/ck")
        meta = _meta(os.path.join(tmp, "ck"))
        entry = meta["tensors"]["t"]
        covered = np.zeros(shape, dtype=int)
        for c in entry["chunks"]:
            covered[tuple(slice(s, e) for s, e in c["box"])] += 1
        assert (covered == 1).all()  # every element stored exactly once
        assert "P(" not in entry["stored_placements"]
        if spec.is_partial and len(shape) > 0:
            assert "S(" in entry["stored_placements"]  # reduced with a reduce-scatter, not to Replicate
        stored = read_state_dict(tmp + "/ck")["t"]
    np.testing.assert_allclose(stored, expected, rtol=1e-12, atol=1e-12)


# ========================================================= the acceptance scenario
def _model_state(meshes_: dict[str, dist.ProcessMesh], rng: np.random.Generator) -> dict[str, Any]:
    """A state dict shaped like a 2-stage GPT's: embedding, column/row-parallel linears per
    stage, layer norms, ZeRO-sharded AdamW moments, a partial gradient, step, RNG, loader."""
    s0, s1 = meshes_["stage0"], meshes_["stage1"]
    R, S, P = dist.Replicate, dist.Shard, dist.Partial

    def put(mesh: dist.ProcessMesh, shape: tuple[int, ...], pls: list[Any], dtype: Any = np.float64) -> dist.Tensor:
        return dist.shard_tensor(rng.standard_normal(shape).astype(dtype), mesh, pls)

    model = {
        "embedding.weight": put(s0, (50, 12), [R(), S(0)]),  # vocab-parallel (uneven: 50 / 2 ... / 4, / 3)
        "blocks.0.ln.weight": put(s0, (12,), [R(), R()]),
        "blocks.0.attn.qkv.weight": put(s0, (12, 36), [R(), S(1)]),  # column-parallel
        "blocks.0.attn.proj.weight": put(s0, (12, 12), [R(), S(0)]),  # row-parallel
        "blocks.1.mlp.fc1.weight": put(s1, (12, 47), [R(), S(1)]),
        "blocks.1.mlp.fc1.bias": put(s1, (47,), [R(), S(0)], np.float32),
        "blocks.1.mlp.fc2.weight": put(s1, (47, 12), [R(), S(0)]),
        "head.weight": put(s1, (12, 50), [R(), S(1)]),
    }
    opt = {
        # ZeRO stage 1/2: the moments are sharded over dp too.
        "embedding.weight.moment1": put(s0, (50, 12), [S(0), S(0)]),
        "blocks.1.mlp.fc1.weight.moment2": put(s1, (12, 47), [S(0), S(1)], np.float32),
        "head.weight.grad": put(s1, (12, 50), [P(), S(1)]),  # a dp-partial gradient, reduced at save
        "beta1_pow": put(s0, (), [R(), R()]),
    }
    return {
        "model": model,
        "optimizer": opt,
        "step": 41,
        "rng": np.random.default_rng(7).bit_generator.state,  # nested dict, 128-bit ints
        "legacy_rng": np.random.RandomState(3).get_state(),  # a tuple holding an array
        "loader": {"epoch": 2, "position": [3, 17], "lr": 2.5e-4, "done": False, "tag": None},
    }


def _like(state: Any, mesh_for: Any, rng: np.random.Generator) -> Any:
    """An empty state of the same names, shapes and dtypes, laid out by ``mesh_for(name, t)``."""
    if isinstance(state, dict):
        return {k: _like(v, lambda n, t, k=k: mesh_for(f"{k}.{n}" if n else k, t), rng) for k, v in state.items()}
    if isinstance(state, dist.Tensor):
        junk = rng.standard_normal(tuple(state.shape)).astype(state.dtype)
        placed = mesh_for("", state)
        return dist.to_tensor(junk) if placed is None else dist.shard_tensor(junk, *placed)
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    return None  # plain values are replaced by the saved ones


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(_flat(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: state}


def _values(state: Any) -> dict[str, Any]:
    return {k: (v.full_tensor() if isinstance(v, dist.Tensor) else v) for k, v in _flat(state).items()}


def _assert_same_values(got: Any, want: dict[str, Any]) -> None:
    got_values = _values(got)
    assert set(got_values) == set(want)
    for k, w in want.items():
        g = got_values[k]
        if isinstance(w, (np.ndarray, np.generic)):
            assert identical(g, w), k
        else:
            assert type(g) is type(w) and g == w, (k, g, w)


def _tp_layout(mesh: dist.ProcessMesh, tp_axis: int) -> Any:
    """Placements on ``mesh`` that shard each tensor's last dim over the tp axis (others R)."""

    def place(name: str, t: dist.Tensor) -> Any:
        pls: list[Any] = [dist.Replicate()] * mesh.ndim
        if t.ndim:
            pls[tp_axis] = dist.Shard(t.ndim - 1)
        if "moment" in name and t.ndim and mesh.ndim > 1:
            pls[1 - tp_axis] = dist.Shard(0)  # keep ZeRO sharding over dp
        return mesh, pls

    return place


def test_dp2_tp2_pp2_on_8_ranks_loads_under_tp4_dp2_and_on_4_3_1_ranks(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    world8 = {
        "stage0": dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"]),
        "stage1": dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["dp", "tp"]),
    }
    state = _model_state(world8, rng)
    want = _values(state)
    path = str(tmp_path / "step41")
    dist.save_state_dict(state, path)
    meta = json.loads((tmp_path / "step41" / METADATA).read_text())
    qkv = meta["tensors"]["model.blocks.0.attn.qkv.weight"]
    assert qkv["placements"] == "RS(1)" and qkv["mesh"]["process_ids"] == [0, 1, 2, 3]
    assert {c["file"] for c in qkv["chunks"]} <= {f"rank{r:05d}.safetensors" for r in range(4)}
    assert meta["tensors"]["optimizer.head.weight.grad"]["stored_placements"] == "S(1)S(1)"

    layouts = {
        # tp4 x dp2 on the same 8 ranks, other axis order, no pipeline.
        "tp4xdp2": (8, lambda: _tp_layout(dist.ProcessMesh(np.arange(8).reshape(4, 2).T.tolist(), ["dp", "tp"]), 1)),
        "4 ranks": (4, lambda: _tp_layout(dist.ProcessMesh([0, 1, 2, 3], ["tp"]), 0)),
        "3 ranks": (3, lambda: _tp_layout(dist.ProcessMesh([2, 0, 1], ["tp"]), 0)),
        "1 rank": (1, lambda: _tp_layout(dist.ProcessMesh([0], ["tp"]), 0)),
        "1 rank, dense": (1, lambda: lambda name, t: None),
    }
    for label, (world, layout) in layouts.items():
        with dist.use_backend(SimBackend(world)):
            target = _like(state, layout(), np.random.default_rng(1))
            dist.load_state_dict(target, path)
            _assert_same_values(target, want)
            if label != "1 rank, dense":
                w = target["model"]["blocks.1.mlp.fc1.weight"]
                assert w.process_mesh.size == (8 if world == 8 else world), label
    # The RNG state resumes the same stream.
    resumed = np.random.default_rng()
    resumed.bit_generator.state = target["rng"]
    assert identical(resumed.random(4), np.random.default_rng(7).random(4))


def test_gpt_training_state_dp2_tp2_pp2_loads_under_tp4_dp2_and_on_4_3_1_ranks(tmp_path: Any) -> None:
    """The same acceptance with a real training state: a GPT on from_degrees(2, 2, 2) after two
    AdamW steps under ZeRO-2, restored with load_training_state into the GPT and optimizer built
    under each target layout (their own ZeRO stage, before any step): every value identical."""
    path = str(tmp_path / "gpt")
    with dist.use_backend(SimBackend(8)):
        state = gpt_training_state.trained_state()
        want = _values(state)
        dist.save_state_dict(state, path)
    meta = _meta(path)
    moment = meta["tensors"]["optimizer.blocks.1.mlp.fc.weight.moment1"]
    assert moment["mesh"]["process_ids"] == [4, 5, 6, 7] and moment["placements"] == "S(0)S(1)"  # ZeRO split over dp
    assert {c["file"] for c in moment["chunks"]} == {f"rank{r:05d}.safetensors" for r in range(4, 8)}
    assert want["step"] == 2 and want["loader.batches_served"] == 2 and want["rng.draws"] > 0

    for label, (world, _, zero) in gpt_training_state.TARGETS.items():
        with dist.use_backend(SimBackend(world)):
            got, opt = gpt_training_state.load_into(label, path)
            _assert_same_values(got, want)
            for p in opt._parameter_list:
                spec = opt.state_tensors()[f"{p.name}.moment2"].spec if label != "1 rank, dense" else None
                assert spec == opt.layout_of(p), (label, p.name)  # read into this optimizer's own layout
            if zero == 3:
                wte = got["model"]["wte.weight"]  # 40 rows stored split over dp=3: uneven
                assert [wte.local_tensor(r).shape[0] for r in range(3)] == [14, 13, 13]


# ============================================================ reading only what overlaps
@settings(max_examples=30)
@given(st.data(), st.lists(st.integers(1, 9), min_size=1, max_size=3))
def test_each_rank_reads_exactly_the_chunks_overlapping_its_shard(data: st.DataObject, shape: list[int]) -> None:
    src_mesh = data.draw(meshes(max_ranks=8))
    src = dist.DistSpec(shape, src_mesh, data.draw(placements_for(src_mesh, len(shape), partial=False)))
    t, _ = make_tensor(src, 0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.save_state_dict({"t": t}, tmp + "/ck", piece_bytes=data.draw(st.sampled_from([16, 1 << 20])))
        chunks = _meta(os.path.join(tmp, "ck"))["tensors"]["t"]["chunks"]
        mesh = data.draw(meshes(max_ranks=8))
        out = dist.shard_tensor(np.zeros(shape), mesh, data.draw(placements_for(mesh, len(shape), partial=False)))
        with record_io() as io:
            dist.load_state_dict({"t": out}, tmp + "/ck")
    for rank in mesh.process_ids:
        box = out.spec.local_box(rank)
        overlapping = {("t", c["key"]) for c in chunks if box_intersect(box, tuple(map(tuple, c["box"]))) is not None}
        assert io.chunks_read_by(rank) == overlapping
    # The process reads each needed chunk once, and nothing else.
    assert len(io.chunk_reads) == len({(c.tensor, c.key) for c in io.chunk_reads})
    data_bytes = sum(c.nbytes for c in io.chunk_reads)
    assert data_bytes == sum(
        c["nbytes"] for c in chunks if ("t", c["key"]) in {(r.tensor, r.key) for r in io.chunk_reads}
    )


def test_a_pipeline_stage_opens_only_its_own_files(tmp_path: Any) -> None:
    """Loading stage 1's tensors never touches the files of stage 0's ranks: deleting them is harmless."""
    rng = np.random.default_rng(3)
    s0 = dist.ProcessMesh([0, 1], ["tp"])
    s1 = dist.ProcessMesh([2, 3], ["tp"])
    a, b = rng.standard_normal((6, 4)), rng.standard_normal((5, 4))
    state = {
        "s0": {"w": dist.shard_tensor(a, s0, [dist.Shard(0)])},
        "s1": {"w": dist.shard_tensor(b, s1, [dist.Shard(1)])},
    }
    dist.save_state_dict(state, str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck")) == [MARKER, METADATA] + [f"rank{r:05d}.safetensors" for r in range(4)]
    os.remove(tmp_path / "ck" / "rank00000.safetensors")
    os.remove(tmp_path / "ck" / "rank00001.safetensors")
    target = dist.shard_tensor(np.zeros((5, 4)), dist.ProcessMesh([1, 0, 2], ["x"]), [dist.Shard(0)])
    with record_io() as io:
        dist.load_state_dict({"s1": {"w": target}}, str(tmp_path / "ck"))
    assert identical(target.full_tensor(), b)
    assert sorted(io.files_opened) == ["rank00002.safetensors", "rank00003.safetensors"]
    with pytest.raises(
        CheckpointError,
        match=r"tensor 's0.w': data file .*rank0000[01]\.safetensors, listed in metadata.json, is missing",
    ):
        dist.load_state_dict({"s0": {"w": dist.to_tensor(np.zeros((6, 4)))}}, str(tmp_path / "ck"))


def test_chunks_landing_whole_in_a_shard_are_read_without_copies(tmp_path: Any) -> None:
    mesh = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    value = np.arange(64 * 8.0).reshape(64, 8)
    dist.save_state_dict({"w": dist.shard_tensor(value, mesh, [dist.Shard(0)])}, str(tmp_path / "ck"), piece_bytes=256)
    target = dist.shard_tensor(np.zeros((64, 8)), mesh, [dist.Shard(0)])
    with record_io() as io:
        dist.load_state_dict({"w": target}, str(tmp_path / "ck"))
    assert identical(target.full_tensor(), value)
    assert len(io.chunk_reads) == 4 * (16 * 64 // 256)  # row slabs of 256 B
    assert io.bytes_read - sum(c.nbytes for c in io.chunk_reads) < 4 * 4096  # plus four small headers


# ======================================================================= corruption
def _chunk_offset(ck: str, tensor: str) -> tuple[str, int, int]:
    """(file, absolute offset, nbytes) of a tensor's first chunk."""
    meta = _meta(ck)
    chunk = meta["tensors"][tensor]["chunks"][0]
    path = os.path.join(ck, chunk["file"])
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start, stop = header[chunk["key"]]["data_offsets"]
    return path, 8 + n + start, stop - start


@pytest.mark.parametrize("target_placements", ["S(0)R", "RS(1)"])  # cut into shards / read straight into one
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_is_refused_naming_tensor_and_file(tmp_path: Any, where: str, target_placements: str) -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    rng = np.random.default_rng(5)
    w, v = rng.standard_normal((9, 7)), rng.standard_normal((3,))
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"w": dist.shard_tensor(w, mesh, [dist.Replicate(), dist.Shard(1)]), "v": v}, ck)
    path, offset, nbytes = _chunk_offset(ck, "w")
    pos = offset + {"first": 0, "middle": nbytes // 2, "last": nbytes - 1}[where]
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    target = dist.shard_tensor(np.zeros((9, 7)), mesh, dist.parse_placements(target_placements))
    name = os.path.basename(path)
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in tensor 'w', chunk 'w#0' .* data file .*{name}"):
        dist.load_state_dict({"w": target}, ck)
    # Entries not stored in the damaged chunk still load.
    state = {"v": np.zeros(3)}
    dist.load_state_dict(state, ck)
    assert identical(state["v"], v)


def test_truncated_and_foreign_files_are_refused(tmp_path: Any) -> None:
    mesh = dist.ProcessMesh([0, 1], ["x"])
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"w": dist.shard_tensor(np.arange(10.0), mesh, [dist.Shard(0)])}, ck)
    path, offset, nbytes = _chunk_offset(ck, "w")
    target = {"w": dist.shard_tensor(np.zeros(10), mesh, [dist.Shard(0)])}
    with open(path, "r+b") as f:
        f.truncate(offset + nbytes - 1)
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors is truncated or corrupted: 'w#0'"):
        dist.load_state_dict(target, ck)
    with open(path, "wb") as f:
        f.write(b"\xff" * 7)
    with pytest.raises(CheckpointError, match=r"data file .*rank00000\.safetensors is truncated"):
        dist.load_state_dict(target, ck)


# ===================================================================== structure
def test_values_and_arrays_round_trip_and_fill_in_place(tmp_path: Any) -> None:
    legacy = np.random.RandomState(11).get_state()
    state = {
        "step": 7,
        "big": 2**100 + 1,
        "floats": [0.1, float("nan"), float("inf"), -float("inf"), -0.0],
        "flag": True,
        "none": None,
        "text": "ünïcode",
        "scalar": np.float32(1.25),
        "ints": {3: "int keys", "x": (1, [2, 3])},
        "legacy_rng": legacy,
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "empty": np.zeros((0, 4)),
        "flags": np.array([True, False]),
        "c64": np.array([1 + 2j], dtype=np.complex64),
    }
    ck = str(tmp_path / "ck")
    dist.save_state_dict(state, ck)
    arr = np.zeros((2, 3), dtype=np.int16)
    frozen = np.zeros(2, dtype=bool)
    frozen.flags.writeable = False
    target: dict[str, Any] = {k: None for k in state}
    target.update(arr=arr, flags=frozen, ints={3: None, "x": (0, [0, 0])})
    dist.load_state_dict(target, ck)
    assert target["arr"] is arr and identical(arr, state["arr"])  # writeable: filled in place
    assert target["flags"] is not frozen and identical(target["flags"], state["flags"])  # read-only: replaced
    assert target["ints"] == {3: "int keys", "x": (1, [2, 3])}
    assert target["big"] == 2**100 + 1 and target["step"] == 7 and target["flag"] is True and target["none"] is None
    assert identical(np.array(target["floats"]), np.array(state["floats"]))
    assert type(target["scalar"]) is np.float32 and target["scalar"] == np.float32(1.25)
    assert target["legacy_rng"][0] == "MT19937" and identical(target["legacy_rng"][1], legacy[1])
    assert target["legacy_rng"][2:] == legacy[2:]
    assert identical(target["empty"], state["empty"]) and identical(target["c64"], state["c64"])
    assert read_state_dict(ck)["ints"] == {3: "int keys", "x": (1, [2, 3])}


def test_reference_and_simulator_checkpoints_are_interchangeable(tmp_path: Any) -> None:
    rng = np.random.default_rng(9)
    value = rng.standard_normal((5, 3))
    with dist.use_backend(ReferenceBackend()):
        mesh = dist.ProcessMesh([0, 1], ["x"])
        dist.save_state_dict({"w": dist.shard_tensor(value, mesh, [dist.Partial()])}, str(tmp_path / "ref"))
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
    t = dist.shard_tensor(np.zeros((5, 3)), mesh, [dist.Shard(1), dist.Partial()])
    dist.load_state_dict({"w": t}, str(tmp_path / "ref"))
    assert identical(t.full_tensor(), value)
    dist.save_state_dict({"w": t}, str(tmp_path / "sim"))
    with dist.use_backend(ReferenceBackend()):
        back = dist.shard_tensor(np.zeros((5, 3)), dist.ProcessMesh([0, 1, 2], ["x"]), [dist.Shard(0)])
        dist.load_state_dict({"w": back}, str(tmp_path / "sim"))
        assert identical(back.full_tensor(), value)


def test_data_files_are_plain_safetensors(tmp_path: Any) -> None:
    mesh = dist.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["dp", "tp"])
    value = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    ck = tmp_path / "ck"
    dist.save_state_dict(
        {"w": dist.shard_tensor(value, mesh, [dist.Shard(1), dist.Shard(0)]), "i": np.arange(3)}, str(ck)
    )
    meta = json.loads((ck / METADATA).read_text())
    seen = 0
    for name, entry in meta["tensors"].items():
        whole = value if name == "w" else np.arange(3)
        for c in entry["chunks"]:
            arrays = safetensors.numpy.load_file(str(ck / c["file"]))
            assert identical(arrays[c["key"]], whole[tuple(slice(s, e) for s, e in c["box"])])
            seen += 1
    assert seen == 7
    # Replicated pieces are spread over the ranks: more than one rank writes.
    assert len(meta["files"]) > 1


def test_overwriting_a_checkpoint_replaces_it_and_leaves_nothing_behind(tmp_path: Any) -> None:
    mesh = dist.ProcessMesh([0, 1], ["x"])
    ck = str(tmp_path / "ck")
    for step in (1, 2):
        dist.save_state_dict({"w": dist.shard_tensor(np.full(4, float(step)), mesh, [dist.Shard(0)]), "step": step}, ck)
    assert os.listdir(tmp_path) == ["ck"]
    state: dict[str, Any] = {"w": dist.to_tensor(np.zeros(4)), "step": 0}
    dist.load_state_dict(state, ck)
    assert state["step"] == 2 and identical(state["w"].full_tensor(), np.full(4, 2.0))


def test_a_failing_save_keeps_the_previous_checkpoint(tmp_path: Any) -> None:
    from mpipar.checkpoint import save as save_module

    ck = str(tmp_path / "ck")
    dist.save_state_dict({"w": np.arange(3.0)}, ck)

    def fail(path: str) -> None:
        raise OSError(f"disk full while writing {path}")

    save_module.after_file_written.append(fail)
    try:
        with pytest.raises(OSError, match="disk full"):
            dist.save_state_dict({"w": np.arange(3.0) + 1}, ck)
    finally:
        save_module.after_file_written.remove(fail)
    assert os.listdir(tmp_path) == ["ck"]  # the temporary directory is cleaned up
    assert identical(read_state_dict(ck)["w"], np.arange(3.0))


def test_a_failing_deferred_fsync_fails_the_save_and_keeps_the_previous_checkpoint(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """The simulator writes every rank's file, each fsync on a worker thread while the next file
    is written: an fsync error (the second file's) still fails the save, after every other fsync
    has finished, and the partial directory is removed."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], ["x"])
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"w": dist.shard_tensor(np.arange(8.0), mesh, [dist.Shard(0)])}, ck)
    real_fsync, synced = os.fsync, []

    def fsync(fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))  # the file behind the descriptor (Linux)
        synced.append(name)
        if name == "rank00001.safetensors":
            raise OSError(5, "Input/output error (fsync)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match=r"Input/output error \(fsync\)"):
        dist.save_state_dict({"w": dist.shard_tensor(np.arange(8.0) + 1, mesh, [dist.Shard(0)])}, ck)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [n for n in synced if n.endswith(".safetensors")] == [f"rank{r:05d}.safetensors" for r in range(4)]
    assert os.listdir(tmp_path) == ["ck"]
    assert identical(read_state_dict(ck)["w"], np.arange(8.0))


def test_writeback_starts_while_a_file_is_still_being_written(tmp_path: Any, monkeypatch: Any) -> None:
    from mpipar.checkpoint import format as fmt

    started: list[tuple[int, int]] = []
    monkeypatch.setattr(fmt, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(fmt, "start_writeback", lambda fd, offset, n: started.append((offset, n)))
    pending = fmt.write_file_durably(str(tmp_path / "f"), [b"a" * 600, b"b" * 600, b"c" * 1500, b"d" * 10], wait=False)
    assert pending is not None
    pending.result()
    assert started == [(0, 1200), (1200, 1500)]  # the last 10 bytes are left to the fsync
    assert (tmp_path / "f").read_bytes() == b"a" * 600 + b"b" * 600 + b"c" * 1500 + b"d" * 10


# ========================================================================== errors
def test_load_errors_name_the_entry_and_the_fix(tmp_path: Any) -> None:
    mesh = dist.ProcessMesh([0, 1], ["x"])
    ck = str(tmp_path / "ck")
    dist.save_state_dict({"model": {"w": dist.shard_tensor(np.zeros((4, 2)), mesh, [dist.Shard(0)])}, "step": 1}, ck)
    with pytest.raises(CheckpointError, match=r"no entry 'model.b' .* under 'model' it holds 'w'"):
        dist.load_state_dict({"model": {"b": dist.to_tensor(np.zeros(2))}}, ck)
    with pytest.raises(
        CheckpointError, match=r"tensor 'model.w' has shape \[4, 3\], but checkpoint .* holds shape \[4, 2\]"
    ):
        dist.load_state_dict({"model": {"w": dist.to_tensor(np.zeros((4, 3)))}}, ck)
    with pytest.raises(
        CheckpointError, match=r"tensor 'model.w' has dtype float32, but .* holds float64; build it with dtype float64"
    ):
        dist.load_state_dict({"model": {"w": dist.to_tensor(np.zeros((4, 2), np.float32))}}, ck)
    with pytest.raises(CheckpointError, match=r"state entry 'step' is a Tensor, but checkpoint .* holds a value there"):
        dist.load_state_dict({"step": dist.to_tensor(np.zeros(1))}, ck)
    with pytest.raises(CheckpointError, match=r"array 'model.w' has shape \[2\]"):
        dist.load_state_dict({"model": {"w": np.zeros(2)}}, ck)
    with pytest.raises(TypeError, match="load_state_dict fills a dict"):
        dist.load_state_dict([1], ck)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nowhere"):
        dist.load_state_dict({"step": 0}, str(tmp_path / "nowhere"))


def test_save_errors_name_the_entry(tmp_path: Any) -> None:
    ck = str(tmp_path / "ck")
    with pytest.raises(TypeError, match=r"state entry 'opt.lr_fn' is a function, which a checkpoint cannot store"):
        dist.save_state_dict({"opt": {"lr_fn": lambda s: s}}, ck)
    with pytest.raises(TypeError, match=r"state entry 'z' has dtype complex128, which safetensors cannot store"):
        dist.save_state_dict({"z": np.zeros(2, np.complex128)}, ck)
    with pytest.raises(ValueError, match=r"\['a.b'\] and \['a', 'b'\] both flatten to the name 'a.b'"):
        dist.save_state_dict({"a.b": np.zeros(1), "a": {"b": np.zeros(1)}}, ck)
    with pytest.raises(TypeError, match=r"state key \(1, 2\) \(tuple\) under 'm'"):
        dist.save_state_dict({"m": {(1, 2): 3}}, ck)
    with pytest.raises(TypeError, match="save_state_dict needs a dict"):
        dist.save_state_dict([np.zeros(1)], ck)  # type: ignore[arg-type]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"non-empty directory without metadata\.json, so not an mpipar checkpoint"):
        dist.save_state_dict({"x": 1}, str(tmp_path / "other"))
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert not os.path.exists(ck)


def test_replicated_pieces_are_spread_evenly_over_their_replicas(tmp_path: Any) -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"])
    value = np.arange(64 * 4.0).reshape(64, 4)  # 2 KiB, cut into 16 slabs of 128 B
    dist.save_state_dict(
        {"w": dist.shard_tensor(value, mesh, [dist.Replicate(), dist.Replicate()])},
        str(tmp_path / "ck"),
        piece_bytes=128,
    )
    meta = json.loads((tmp_path / "ck" / METADATA).read_text())
    per_file: dict[str, int] = {}
    for c in meta["tensors"]["w"]["chunks"]:
        per_file[c["file"]] = per_file.get(c["file"], 0) + c["nbytes"]
    assert per_file == {f"rank{r:05d}.safetensors": 512 for r in range(4)}
    assert identical(read_state_dict(str(tmp_path / "ck"))["w"], value)


@pytest.mark.parametrize("bounce", [8, 24, 1 << 20])
def test_strided_shards_stream_through_the_bounce_buffer(tmp_path: Any, monkeypatch: Any, bounce: int) -> None:
    """Column shards are strided views; they are written slab by slab (or whole when one row
    exceeds the buffer) with the same bytes and CRCs as a contiguous copy."""
    from mpipar.checkpoint import save as save_module

    monkeypatch.setattr(save_module, "_BOUNCE_BYTES", bounce)
    mesh = dist.ProcessMesh([0, 1, 2], ["tp"])
    value = np.arange(7 * 10 * 3, dtype=np.float64).reshape(7, 10, 3)
    t = dist.shard_tensor(value, mesh, [dist.Shard(1)])
    assert not t.local_tensor(0).flags.c_contiguous
    dist.save_state_dict({"w": t}, str(tmp_path / "ck"))
    assert identical(read_state_dict(str(tmp_path / "ck"))["w"], value)
