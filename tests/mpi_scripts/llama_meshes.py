"""The tiny Llama (and GPT under cp) trained two AdamW steps on several meshes, in one launch.

    mpiexec -n 8 python tests/mpi_scripts/llama_meshes.py DIR    # DIR: shared by the processes
    python -m simulator -n 8 tests/mpi_scripts/llama_meshes.py DIR
    python -m simulator --reference tests/mpi_scripts/llama_meshes.py DIR

Prints ``<case> step <n> loss <v>`` per case (data, tensor with key/value heads split and
replicated, sequence, pipeline and context parallel, with fused and plain attention), float64;
every case must print the one-device losses (``single``) in every launch mode. A checkpoint in
the Hugging Face safetensors layout, written by rank 0 when ``safetensors`` is importable, is
loaded into each mesh first, so loading is checked on every mesh and backend too.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.models.llama import Llama, LlamaParallel, hf_state_dict, llama_config, load_hf_llama

CASES: list[tuple[str, str, dict[str, object]]] = [
    ("single", "fused", {}),
    ("dp2", "fused", {"dp": 2}),
    ("tp2-sp", "fused", {"tp": 2, "sequence_parallel": True}),
    ("tp4-kv-replicated", "plain", {"tp": 4}),
    ("pp2-tp2", "fused", {"pp": 2, "tp": 2}),
    ("cp2", "fused", {"cp": 2}),
    ("cp2-plain", "plain", {"cp": 2}),
    ("dp2-cp2-tp2-sp", "fused", {"dp": 2, "cp": 2, "tp": 2, "sequence_parallel": True}),
    ("cp4-ring", "fused", {"cp": 4, "cp_comm": "ring"}),
    ("dp2-cp2-tp2-ring", "fused", {"dp": 2, "cp": 2, "tp": 2, "cp_comm": "ring"}),
    ("gpt-single", "plain", {}),
    ("gpt-cp2-tp2", "fused", {"cp": 2, "tp": 2}),
    ("gpt-dp2-cp2-plain", "plain", {"cp": 2, "dp": 2}),
]

BATCH, STEPS = 4, 2


def _checkpoint(directory: str) -> str | None:
    """The tiny Llama's initial weights in the HF layout, written once by rank 0 (None without safetensors)."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        return None
    path = os.path.join(directory, "model.safetensors")
    dist.seed(7)
    donor = Llama(llama_config("tiny", dtype="float64"))
    weights = hf_state_dict(donor)
    if dist.get_rank() == 0:
        save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, path)
    if dist.current_backend().name == "mpi":
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
    return path


def main() -> None:
    dist.nn.set_default_dtype("float64")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (STEPS, BATCH, 17))
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()  # one shared by every process
    ckpt = _checkpoint(directory)
    for name, attention, degrees in CASES:
        kw = dict(degrees)
        par = (GPTParallel if name.startswith("gpt") else LlamaParallel).from_degrees(**kw)  # type: ignore[arg-type]
        dist.seed(3)
        if name.startswith("gpt"):
            cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=16, dtype="float64")
            model = GPT(GPTConfig(**{**cfg.__dict__, "attention": attention}), par)
        else:
            model = Llama(llama_config("tiny", dtype="float64", attention=attention), par)
            if ckpt is not None:
                load_hf_llama(model, ckpt)
        opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
        meshes = par.stage_meshes
        for step in range(STEPS):
            x, y = tokens[step, :, :-1], tokens[step, :, 1:]
            if meshes:
                pls = par.activation(meshes[0], seq_split=False)
                xs = dist.shard_tensor(x, meshes[0], [p if p.is_shard(0) else dist.Replicate() for p in pls])
                pls = par.activation(meshes[-1], seq_split=False)
                ys = dist.shard_tensor(y, meshes[-1], [p if p.is_shard(0) else dist.Replicate() for p in pls])
            else:
                xs, ys = dist.Tensor(x), dist.Tensor(y)
            loss = model.loss(xs, ys)
            loss.backward()
            opt.step()
            opt.clear_grad()
            dist.print_once(f"{name} step {step} loss {float(loss):.15g}", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
