"""Paddle's ``paddle.static`` for mpipar: static-graph programs recorded from mpipar's ops.

    import mpipar as paddle
    paddle.enable_static()
    with paddle.static.program_guard(paddle.static.default_main_program()):
        img = paddle.static.data(name="img", shape=[None, 256], dtype="float32")
        ...
        optimizer.minimize(loss)
    exe = paddle.static.Executor()
    exe.run(paddle.static.default_startup_program())
    loss_v, = exe.run(feed={"img": x, ...}, fetch_list=[loss.name])

The implementation and its semantics (one with eager: the program is the recorded graph of
the same ops) are ``mpipar.compile.program``'s. Names of ``paddle.static`` that mpipar does not
have are importable and refuse when used, naming the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mpipar.compat.unsupported import unsupported
from mpipar.compile.program import (
    Block,
    CPUPlace,
    CUDAPlace,
    Executor,
    InputSpec,
    Place,
    Program,
    data,
    default_main_program,
    default_startup_program,
    program_guard,
)
from mpipar.nn.functional import accuracy
from mpipar.tensor import Tensor as Variable


def cpu_places(device_count: int | None = None) -> list[CPUPlace]:
    return [CPUPlace() for _ in range(device_count or 1)]


def cuda_places(device_ids: list[int] | None = None) -> list[CUDAPlace]:
    return [CUDAPlace(i) for i in (device_ids if device_ids is not None else [0])]


@contextlib.contextmanager
def name_scope(prefix: str | None = None) -> Iterator[None]:
    """Paddle's ``static.name_scope``: accepted; mpipar names variables by op and count."""
    yield


_NO_SCOPE = "mpipar programs keep values in their tensors (parameters are the layers' own); there is no scope"
CompiledProgram = unsupported("paddle.static.CompiledProgram", "pass the Program itself to Executor.run")
ParallelExecutor = unsupported("paddle.static.ParallelExecutor", "use paddle.distributed.Engine or to_static")
BuildStrategy = unsupported("paddle.static.BuildStrategy", "mpipar builds no fused passes")
ExecutionStrategy = unsupported("paddle.static.ExecutionStrategy", "mpipar has one executor")
global_scope = unsupported("paddle.static.global_scope", _NO_SCOPE)
scope_guard = unsupported("paddle.static.scope_guard", _NO_SCOPE)
append_backward = unsupported("paddle.static.append_backward", "use optimizer.minimize(loss)")
gradients = unsupported("paddle.static.gradients", "use optimizer.minimize(loss)")
save = unsupported("paddle.static.save", "save the layer's state with paddle.save / dist.save_state_dict")
load = unsupported("paddle.static.load", "load the layer's state with paddle.load / dist.load_state_dict")
save_inference_model = unsupported("paddle.static.save_inference_model", "mpipar has no inference format")
load_inference_model = unsupported("paddle.static.load_inference_model", "mpipar has no inference format")
serialize_program = unsupported("paddle.static.serialize_program", "print(program) lists it; its plan saves as JSON")
deserialize_program = unsupported("paddle.static.deserialize_program", "programs are rebuilt from the code")
set_program_state = unsupported("paddle.static.set_program_state", "set the layer's state_dict")
load_program_state = unsupported("paddle.static.load_program_state", "load the layer's state_dict")
create_global_var = unsupported("paddle.static.create_global_var", "use a paddle.to_tensor constant")
create_parameter = unsupported("paddle.static.create_parameter", "create parameters in a paddle.nn.Layer")
py_func = unsupported("paddle.static.py_func", "write the function with mpipar ops")
Print = unsupported("paddle.static.Print", "fetch the variable with Executor.run(fetch_list=[...])")
device_guard = unsupported("paddle.static.device_guard", "place work with ProcessMesh and shard_op")
nn = unsupported("paddle.static.nn", "use the paddle.nn layers (paddle.nn.Linear, ...) on static.data")
amp = unsupported("paddle.static.amp", "mixed precision is not supported in static programs")
ExponentialMovingAverage = unsupported("paddle.static.ExponentialMovingAverage", "not supported")
auc = unsupported("paddle.static.auc", "compute the metric from fetched values")

__all__ = [
    "Block",
    "BuildStrategy",
    "CPUPlace",
    "CUDAPlace",
    "CompiledProgram",
    "ExecutionStrategy",
    "Executor",
    "ExponentialMovingAverage",
    "InputSpec",
    "ParallelExecutor",
    "Place",
    "Print",
    "Program",
    "Variable",
    "accuracy",
    "amp",
    "append_backward",
    "auc",
    "cpu_places",
    "create_global_var",
    "create_parameter",
    "cuda_places",
    "data",
    "default_main_program",
    "default_startup_program",
    "deserialize_program",
    "device_guard",
    "global_scope",
    "gradients",
    "load",
    "load_inference_model",
    "load_program_state",
    "name_scope",
    "nn",
    "program_guard",
    "py_func",
    "save",
    "save_inference_model",
    "scope_guard",
    "serialize_program",
    "set_program_state",
]
