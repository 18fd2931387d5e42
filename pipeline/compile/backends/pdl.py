"""Programmatic dependent launch (PDL) in the cuda backend's AOTInductor packages.

A batch-1 decode step is ~170 short kernels, and without PDL each one's blocks are only
scheduled once the kernel before it has finished and its memory is flushed: the launch and
the ramp-up of every kernel stand in the step's critical path (docs/cuda.md). On Hopper
and newer GPUs a kernel launched with the programmatic-stream-serialization attribute is
scheduled while the one before it drains, and waits on the device (``griddepcontrol.wait``)
before it touches memory.

Inductor writes the device side when ``triton.enable_pdl`` is set (``gdc_wait`` /
``gdc_launch_dependents`` in each Triton kernel; torch/_inductor/codegen/triton.py,
``_handle_pdl_before_access``), and its Python launcher sets the attribute. AOTInductor's C++
launcher does not: ``launchKernel`` in torch/_inductor/codegen/cuda/device_op_overrides.py
calls plain ``cuLaunchKernel``. While a package is compiled, ``launches()`` below

- adds ``launchKernelPdl`` (``cuLaunchKernelEx`` with the attribute) to the wrapper's
  helpers and launches with it exactly the kernels whose ``triton_meta`` says
  ``launch_pdl`` (never cuDNN's, cuBLAS's, templates' or user kernels');
- makes each such kernel wait before its first load or store. Inductor waits only where the
  kernel just before wrote what it reads, but a kernel that does not wait can finish before
  its own predecessor does, so a read two kernels downstream could race. Waiting first
  keeps the stream's order and still hides each launch behind the previous kernel's tail.

A CUDA graph captured around such a package records programmatic edges (CUDA 12.3+), so
the runtime's CUDA graphs keep the gain.

Limits: the patches are process-wide while they last (compile workers are processes of their
own, one compile each); a kernel's RNG seed is read without a wait (inductor's ``load_seed``),
which decode and prefill graphs, having no randomness, never do.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

OPTION = "triton.enable_pdl"
OFF = f"compile with the flag inductor.{OPTION}=false"

LAUNCH_PDL = r"""
static inline void launchKernelPdl(
        CUfunction func, uint32_t gridX, uint32_t gridY, uint32_t gridZ,
        uint32_t numWarps, uint32_t sharedMemBytes, void* args[], cudaStream_t stream) {
    CUlaunchAttribute attr[1];
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[0].value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig cfg = {};
    cfg.gridDimX = gridX;
    cfg.gridDimY = gridY;
    cfg.gridDimZ = gridZ;
    cfg.blockDimX = 32 * numWarps;
    cfg.blockDimY = 1;
    cfg.blockDimZ = 1;
    cfg.sharedMemBytes = sharedMemBytes;
    cfg.hStream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CUDA_DRIVER_CHECK(cuLaunchKernelEx(&cfg, func, args, nullptr));
}
"""


def wanted(options: dict[str, Any]) -> bool:
    return bool(options.get(OPTION))


@contextlib.contextmanager
def launches(options: dict[str, Any]) -> Iterator[list[str]]:
    """While compiling with ``options``: PDL kernels that wait first, launched with PDL by
    AOTInductor's C++ wrapper. Yields the list that the kernels' names are added to as their
    launches are written. Does nothing unless ``triton.enable_pdl`` is set."""
    launched: list[str] = []
    if not wanted(options):
        yield launched
        return
    with contextlib.ExitStack() as stack:
        for target, name, wrap in _patches(launched):
            original = getattr(target, name)
            setattr(target, name, wrap(original))
            stack.callback(setattr, target, name, original)
        import torch._inductor.config as inductor_config

        # A graph cached by a compile without these patches must not be reused.
        stack.enter_context(inductor_config.patch({"fx_graph_cache": False}))
        yield launched


def _patches(launched: list[str]) -> list[tuple[Any, str, Any]]:
    try:
        from torch._inductor.codegen.cpp_wrapper_gpu import DeferredTritonCallWrapper
        from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
        from torch._inductor.codegen.triton import TritonKernel
        from torch._inductor.virtualized import V
    except ImportError as e:  # a torch whose inductor is laid out otherwise
        raise RuntimeError(f"{OPTION}: this torch's inductor cannot be patched ({e}); {OFF}") from e
    for target, name in (
        (DeferredTritonCallWrapper, "generate_launch_kernel"),
        (CUDADeviceOpOverrides, "kernel_driver"),
        (TritonKernel, "_handle_pdl_before_access"),
    ):
        if not callable(getattr(target, name, None)):
            raise RuntimeError(f"{OPTION}: this torch has no {target.__name__}.{name}; {OFF}")
    # wait_first relies on inductor waiting unconditionally where there is no previous node
    # (torch 2.11-2.13, codegen/triton.py); a torch that decides otherwise must not get PDL
    # launches, or a kernel could read what the kernel two before it has not yet written.
    if "prev_node is None" not in inspect.getsource(TritonKernel._handle_pdl_before_access):
        raise RuntimeError(f"{OPTION}: this torch's inductor decides its waits otherwise; {OFF}")

    def driver(original):
        def kernel_driver(self) -> str:
            return original(self) + LAUNCH_PDL

        return kernel_driver

    def launch(original):
        def generate_launch_kernel(self, prefix, wrapper, kernel_var_name, params):
            start = len(prefix._lines)
            original(self, prefix, wrapper, kernel_var_name, params)
            if not params.get("triton_meta", {}).get("launch_pdl"):
                return
            for i in range(start, len(prefix._lines)):
                line = prefix._lines[i]
                if isinstance(line, str) and line.lstrip().startswith("launchKernel("):
                    prefix._lines[i] = line.replace("launchKernel(", "launchKernelPdl(", 1)
                    launched.append(kernel_var_name)

        return generate_launch_kernel

    def wait_first(original):
        def handle(self, wait_buffer, *dependencies, **kwargs):
            scheduler = V.graph.scheduler
            if scheduler is None:
                return original(self, wait_buffer, *dependencies, **kwargs)
            # No previous node: inductor then waits unconditionally.
            saved, scheduler.previous_node = scheduler.previous_node, None
            try:
                return original(self, wait_buffer, *dependencies, **kwargs)
            finally:
                scheduler.previous_node = saved

        return handle

    return [
        (CUDADeviceOpOverrides, "kernel_driver", driver),
        (DeferredTritonCallWrapper, "generate_launch_kernel", launch),
        (TritonKernel, "_handle_pdl_before_access", wait_first),
    ]
