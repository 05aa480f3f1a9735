"""CUDA graphs with device-side branches: captured PyTorch graphs composed under CUDA graph IF nodes.

The decode step (``decode_step.DecodeStep``) skips the routed units that no row's token enters. Deciding
that on the host costs a synchronisation per decision (the GPU idles for a round trip each time). A CUDA
graph conditional node (an IF node, CUDA 12.4+) takes the decision on the device instead: a one-warp
kernel reads the decision (a bool tensor: set if any element is) and sets the node's condition, and the node
runs its body graph only when it is set. An IF node costs about 6 us on an H200 whatever it decides, and its
body's first node about 4 us more (benchmarks/if_node_cost.py; BENCHMARKS.md, fortieth session).

PyTorch's ``CUDAGraph`` has no public binding for IF nodes in the versions this project runs (2.11 on the device,
2.13 in CI), so this module builds them with NVIDIA's own Python bindings (``cuda-bindings``, the
``cuda.bindings.driver`` and ``cuda.bindings.nvrtc`` modules): every segment
between decisions is captured by ``torch.cuda.graph`` as before (PyTorch's allocator and memory pool
included), kept as a ``cudaGraph_t`` (``keep_graph=True``), and added to one outer graph as a child graph
node, nested in IF nodes where a decision guards it. One launch then runs the whole step.
"""

from __future__ import annotations

import ctypes

import torch

# One warp sets the IF node's condition: whether any of a decision's n flags (one per row) is set, and when it
# is, adds the units the IF node's body runs to a device counter (DecodeStep.unit_calls; none when null).
# cudaGraphSetConditional is a device-runtime builtin (no relocatable-code link step), declared here so that
# NVRTC needs no CUDA headers.
_SET_CONDITION = rb"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __global__ void set_condition(cudaGraphConditionalHandle handle, const bool* flags, int n,
                                         long long* counter, long long add) {
    bool any = false;
    for (int i = threadIdx.x; i < n; i += blockDim.x) any |= flags[i];
    any = __any_sync(0xffffffffu, any);
    if (threadIdx.x == 0) {
        if (any && counter) *counter += add;
        cudaGraphSetConditional(handle, any ? 1u : 0u);
    }
}
"""

_kernels: dict[int, object] = {}  # device index -> the compiled set_condition function


def unavailable_reason(device: torch.device) -> str | None:
    """None when IF nodes can be built on ``device``, else why not (CPU, no ``cuda-bindings``, old driver)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
        return f"torch {torch.__version__} cannot keep a captured graph for composing (CUDAGraph.raw_cuda_graph)"
    try:
        from cuda.bindings import driver  # noqa: F401
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return "the cuda-bindings package is not installed (pip install cuda-bindings)"
    version = _check(driver.cuDriverGetVersion())
    if version < 12040:
        return f"the CUDA driver ({version // 1000}.{version % 1000 // 10}) is older than 12.4"
    return None


def _check(result):
    """A cuda-bindings call's (error, *values): the values, or RuntimeError for an error code."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA graph conditional nodes: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


def _set_condition_kernel(device: torch.device):
    from cuda.bindings import driver, nvrtc

    index = torch.device(device).index or 0
    if index not in _kernels:
        major, minor = torch.cuda.get_device_capability(index)
        program = _check(nvrtc.nvrtcCreateProgram(_SET_CONDITION, b"set_condition.cu", 0, [], []))
        options = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        err, = nvrtc.nvrtcCompileProgram(program, len(options), options)
        if int(err) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(program))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile the IF-node kernel: {log.decode(errors='replace')}")
        size = _check(nvrtc.nvrtcGetCUBINSize(program))
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin))
        module = _check(driver.cuModuleLoadData(cubin))
        _kernels[index] = (module, _check(driver.cuModuleGetFunction(module, b"set_condition")))
    return _kernels[index][1]


def _add_node(graph, deps: list, params):
    """``cuGraphAddNode``: newer bindings take the dependencies' edge data too."""
    from cuda.bindings import driver

    try:
        return _check(driver.cuGraphAddNode(graph, deps, None, len(deps), params))
    except TypeError:  # bindings before the edge-data argument
        return _check(driver.cuGraphAddNode(graph, deps, len(deps), params))


class ConditionalGraph:
    """An outer CUDA graph built from captured PyTorch graphs, in order, some under IF nodes.

    ``add(graph, body)`` appends a captured ``torch.cuda.CUDAGraph`` (made with ``keep_graph=True``) to
    ``body`` (None: the outer graph); ``add_if(flag, body)`` appends an IF node that runs the returned body
    only when the 0-dim bool CUDA tensor ``flag`` is true when the node is reached. Nodes of one body run
    one after another. ``instantiate()`` once, then ``launch()`` on the current stream. The captured graphs
    and ``flag`` tensors must stay alive as long as this object (their memory is baked into its nodes).
    """

    def __init__(self, device: torch.device):
        from cuda.bindings import driver

        self._driver = driver
        self.device = torch.device(device)
        with torch.cuda.device(self.device):  # its primary context current: the kernel's and the handles'
            self._kernel = _set_condition_kernel(self.device)
            self._ctx = _check(driver.cuCtxGetCurrent())
        self._root = _check(driver.cuGraphCreate(0))
        self._last: dict[int, list] = {int(self._root): []}  # body -> its last node (a one-element list)
        self._keep: list = []  # the captured graphs and flags the nodes point into
        self._exec = None

    def _append(self, body, add):
        body = self._root if body is None else body
        deps = self._last[int(body)]
        node = add(body, deps)
        self._last[int(body)] = [node]
        return node

    def add(self, graph: torch.cuda.CUDAGraph, body=None) -> None:
        driver = self._driver
        self._keep.append(graph)
        child = driver.CUgraph(graph.raw_cuda_graph())
        self._append(body, lambda b, deps: _check(driver.cuGraphAddChildGraphNode(b, deps, len(deps), child)))

    def add_if(self, flag: torch.Tensor, body=None, counter: tuple[torch.Tensor, int] | None = None):
        """An IF node appended to ``body``, on whether any element of the bool CUDA tensor ``flag`` is set when
        the node is reached; returns the IF node's own body, empty. ``counter``: (an int64 0-dim CUDA tensor,
        n): add n to it whenever the body runs."""
        driver = self._driver
        if flag.dtype != torch.bool or not flag.is_cuda or not flag.is_contiguous():
            raise ValueError("an IF node's flag is a contiguous bool CUDA tensor")
        if counter is not None and (counter[0].dtype != torch.int64 or counter[0].numel() != 1):
            raise ValueError("an IF node's counter is a one-element int64 CUDA tensor")
        self._keep.append(flag)
        handle = _check(driver.cuGraphConditionalHandleCreate(self._root, self._ctx, 0,
                                                             driver.CU_GRAPH_COND_ASSIGN_DEFAULT))
        kernel = driver.CUDA_KERNEL_NODE_PARAMS()
        kernel.func = self._kernel
        kernel.gridDimX = kernel.gridDimY = kernel.gridDimZ = 1
        kernel.blockDimX, kernel.blockDimY, kernel.blockDimZ = 32, 1, 1
        kernel.sharedMemBytes = 0
        count, add = (None, 0) if counter is None else (counter[0], counter[1])
        if count is not None:
            self._keep.append(count)
        kernel.kernelParams = ((int(handle), flag.data_ptr(), flag.numel(), 0 if count is None else count.data_ptr(),
                                add), (ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_longlong))
        self._keep.append(kernel)
        self._append(body, lambda b, deps: _check(driver.cuGraphAddKernelNode(b, deps, len(deps), kernel)))
        params = driver.CUgraphNodeParams()
        params.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 1
        params.conditional.ctx = self._ctx
        self._append(body, lambda b, deps: _add_node(b, deps, params))
        inner = params.conditional.phGraph_out[0]
        self._keep.append(params)
        self._last[int(inner)] = []
        return inner

    def instantiate(self) -> None:
        self._exec = _check(self._driver.cuGraphInstantiate(self._root, 0))

    def launch(self) -> None:
        """On the device's current stream."""
        stream = self._driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        _check(self._driver.cuGraphLaunch(self._exec, stream))

    def __del__(self):
        driver = getattr(self, "_driver", None)
        if driver is None:
            return
        if self._exec is not None:
            driver.cuGraphExecDestroy(self._exec)
        driver.cuGraphDestroy(self._root)
