"""What the cuda backend changes in inductor while a package compiles: programmatic dependent
launches in AOTInductor's C++ wrapper (``backends/pdl.py``) and how kernels are timed while
they are tuned (``backends/tuning.py``). Each change is checked against the torch installed
here (so a torch whose inductor moved fails here, not on a GPU box), and undone on exit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch._inductor.config as inductor_config
from torch._inductor.codegen.cpp_wrapper_gpu import DeferredTritonCallWrapper
from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
from torch._inductor.codegen.triton import TritonKernel
from torch._inductor.runtime import benchmarking
from torch._inductor.utils import IndentedBuffer
from torch._inductor.virtualized import V

from pipeline.compile.backends import pdl, tuning
from pipeline.compile.backends.aoti import CpuBackend, CudaBackend

PATCHED = (
    (DeferredTritonCallWrapper, "generate_launch_kernel"),
    (CUDADeviceOpOverrides, "kernel_driver"),
    (TritonKernel, "_handle_pdl_before_access"),
)


def originals():
    return {name: getattr(target, name) for target, name in PATCHED}


def test_the_cuda_backend_asks_for_pdl_and_the_cpu_backend_does_not():
    assert pdl.wanted(CudaBackend().inductor_options([]))
    assert not pdl.wanted(CpuBackend().inductor_options([]))
    # a release can turn it off among its compiler flags
    assert not pdl.wanted(CudaBackend().inductor_options(["inductor.triton.enable_pdl=false"]))


def test_cuda_prefill_packages_skip_coordinate_descent_tuning_unless_a_flag_asks():
    cuda, cpu = CudaBackend(), CpuBackend()
    assert cuda.inductor_options([])["coordinate_descent_tuning"] is True  # decode: tuned
    assert cuda.prefill_options([])["coordinate_descent_tuning"] is False
    flag = ["inductor.coordinate_descent_tuning=true"]
    assert cuda.prefill_options(flag)["coordinate_descent_tuning"] is True
    # the difference is in the cuda key; cpu prefill and decode take the same options
    assert cuda.key_options([])["inductor_prefill"]["coordinate_descent_tuning"] is False
    assert "inductor_prefill" not in cuda.key_options(flag)
    assert cpu.prefill_options([]) == cpu.inductor_options([])
    assert "inductor_prefill" not in cpu.key_options([])


def test_without_the_option_nothing_is_patched():
    before = originals()
    with pdl.launches({}) as launched:
        assert originals() == before
        assert CUDADeviceOpOverrides().kernel_driver().count("launchKernelPdl") == 0
    assert launched == []


def test_with_the_option_the_wrapper_gets_a_pdl_launcher_and_everything_is_undone():
    before, cache = originals(), inductor_config.fx_graph_cache
    with pdl.launches({pdl.OPTION: True}):
        driver = CUDADeviceOpOverrides().kernel_driver()
        assert "static inline void launchKernelPdl(" in driver
        assert "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION" in driver
        assert "cuLaunchKernelEx(" in driver
        assert "static inline void launchKernel(" in driver  # the plain one stays for others
        assert inductor_config.fx_graph_cache is False  # no graph compiled without the patch
        assert all(getattr(t, n) is not before[n] for t, n in PATCHED)
    assert originals() == before
    assert inductor_config.fx_graph_cache == cache
    assert "launchKernelPdl" not in CUDADeviceOpOverrides().kernel_driver()


def wrapper(name, launched):
    return next(wrap for target, n, wrap in pdl._patches(launched) if n == name)


def test_only_kernels_generated_for_pdl_are_launched_with_it():
    launched: list[str] = []

    def original(self, prefix, wrapper_, kernel_var_name, params):
        prefix.writeline("void* kernel_args_[] = {&a};")
        prefix.writeline(f"launchKernel({kernel_var_name}, grid_0, grid_1, grid_2, 4, 0);")

    generate = wrapper("generate_launch_kernel", launched)(original)
    prefix = IndentedBuffer()
    prefix.writeline("launchKernel(earlier_kernel, 1, 1, 1, 4, 0);")  # not this call's
    generate(None, prefix, None, "k_pdl", {"triton_meta": {"launch_pdl": True}})
    generate(None, prefix, None, "k_plain", {"triton_meta": {"launch_pdl": False}})
    generate(None, prefix, None, "k_user", {"triton_meta": {}})  # user kernels say nothing
    text = prefix.getvalue()
    assert "launchKernel(earlier_kernel" in text
    assert "launchKernelPdl(k_pdl," in text
    assert "launchKernel(k_plain," in text and "launchKernel(k_user," in text
    assert launched == ["k_pdl"]


def test_every_pdl_kernel_waits_before_it_touches_memory():
    seen = []

    def original(self, wait_buffer, *dependencies, consider_reads=False):
        seen.append((V.graph.scheduler.previous_node, dependencies, consider_reads))

    handle = wrapper("_handle_pdl_before_access", [])(original)
    scheduler = SimpleNamespace(previous_node="node that wrote something else")
    with V.set_graph_handler(SimpleNamespace(scheduler=scheduler)):
        handle(None, "buffer", "buf0", consider_reads=True)
    # inductor waits whenever there is no previous node; the real one is put back after
    assert seen == [(None, ("buf0",), True)]
    assert scheduler.previous_node == "node that wrote something else"


def test_clean_timings_replace_the_gpu_benchmark_only_for_cuda_and_only_while_compiling():
    bench = benchmarking.benchmarker
    before, local = bench.benchmark_gpu, inductor_config.autotune_local_cache
    with tuning.clean_timings("cpu"):
        assert bench.benchmark_gpu == before
    with tuning.clean_timings("cuda"):
        assert "benchmark_gpu" in vars(bench) and bench.benchmark_gpu != before
        assert inductor_config.autotune_local_cache is False  # no configs timed the old way
    assert bench.benchmark_gpu == before
    assert "benchmark_gpu" not in vars(bench)
    assert inductor_config.autotune_local_cache == local


def test_a_failing_compile_still_undoes_every_patch():
    before, bench = originals(), benchmarking.benchmarker.benchmark_gpu
    with (
        pytest.raises(RuntimeError),
        pdl.launches({pdl.OPTION: True}),
        tuning.clean_timings("cuda"),
    ):
        raise RuntimeError("compile failed")
    assert originals() == before
    assert benchmarking.benchmarker.benchmark_gpu == bench


def test_a_torch_that_decides_its_waits_otherwise_gets_no_pdl(monkeypatch):
    def handle(self, wait_buffer, *dependencies, consider_reads=False):
        return None  # waits decided some other way

    monkeypatch.setattr(TritonKernel, "_handle_pdl_before_access", handle)
    with (
        pytest.raises(RuntimeError, match=r"triton.enable_pdl=false"),
        pdl.launches({pdl.OPTION: True}),
    ):
        pass
    assert TritonKernel._handle_pdl_before_access is handle  # nothing was left patched
