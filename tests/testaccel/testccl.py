"""The process-group backend "testccl" for testaccel tensors: each collective copies
its tensors to host memory, runs gloo's collective there, copies the results back and
returns a completed Work."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed import ReduceOp

DEVICE_TYPE = "testaccel"
BACKEND = "testccl"
GLOO_PREFIX = "testccl-gloo/"

_registered = False


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor with `tensor`'s values (itself where it is one)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format)


def _hosts(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_host(tensor) for tensor in tensors]


def _write_back(targets: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
    for target, host in zip(targets, hosts, strict=True):
        if target is not host:
            target.copy_(host)


def _done(result: Sequence[torch.Tensor] | None = None) -> dist.Work:
    """A completed Work whose future holds `result` (the caller's own tensors)."""
    result = list(result or [])
    devices = sorted(
        {t.device for t in result if t.device.type == DEVICE_TYPE},
        key=lambda d: d.index,
    )
    future: torch.futures.Future = torch.futures.Future(devices=devices)
    future.set_result(result)
    return _create_work_from_future(future)


def _is_avg(op) -> bool:
    return op == ReduceOp.AVG


def _gloo_op(op):
    """gloo has no AVG: sum, then divide."""
    return ReduceOp.SUM if _is_avg(op) else op


def _average(tensors: Sequence[torch.Tensor], size: int) -> None:
    for tensor in tensors:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(size)
        else:
            tensor.floor_divide_(size)


class TestCCL(dist.ProcessGroup):
    """A process group over gloo for testaccel (and CPU) tensors."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._gloo = dist.ProcessGroupGloo(
            dist.PrefixStore(GLOO_PREFIX, store), rank, size, timeout
        )
        self._group_name = ""
        self._group_desc = ""

    # Identity.

    def getBackendName(self) -> str:  # noqa: N802 (the C++ name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    # A ProcessGroup keeps its name on its backends; this one has none of torch's.
    def getGroupName(self) -> str:  # noqa: N802 (the C++ name)
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 (the C++ name)
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 (the C++ name)
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 (the C++ name)
        self._group_desc = desc

    # Collectives.

    def allreduce(self, tensors, opts=None):
        if isinstance(opts, ReduceOp | ReduceOp.RedOpType):
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        opts = opts or dist.AllreduceOptions()
        op = opts.reduceOp
        hosts = _hosts(tensors)
        gloo_opts = dist.AllreduceOptions()
        gloo_opts.reduceOp = _gloo_op(op)
        self._gloo.allreduce(hosts, gloo_opts).wait()
        if _is_avg(op):
            _average(hosts, self._size)
        _write_back(tensors, hosts)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        for tensor in tensors:
            single = dist.AllreduceOptions()
            single.reduceOp = opts.reduceOp
            self.allreduce([tensor], single)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        hosts = _hosts(tensors)
        gloo_opts = dist.BroadcastOptions()
        gloo_opts.rootRank = opts.rootRank
        gloo_opts.rootTensor = opts.rootTensor
        self._gloo.broadcast(hosts, gloo_opts).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        inputs = _hosts(input_tensors)
        outputs = [_hosts(outs) for outs in output_tensors]
        self._gloo.allgather(outputs, inputs).wait()
        for targets, hosts in zip(output_tensors, outputs, strict=True):
            _write_back(targets, hosts)
        return _done([t for outs in output_tensors for t in outs])

    def _allgather_base(self, output, input, opts=None):
        chunks = list(output.chunk(self._size))
        self.allgather([chunks], [input])
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self._allgather_base(output, input)
        return _done(outputs)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        for outputs, input in zip(output_lists, input_list, strict=True):
            self.allgather([outputs], [input])
        return _done([t for outs in output_lists for t in outs])

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        op = opts.reduceOp
        for output, inputs in zip(output_tensors, input_tensors, strict=True):
            # gloo has no reduce_scatter of lists: reduce all, keep this rank's part.
            stacked = torch.stack([_host(t) for t in inputs])
            gloo_opts = dist.AllreduceOptions()
            gloo_opts.reduceOp = _gloo_op(op)
            self._gloo.allreduce([stacked], gloo_opts).wait()
            mine = stacked[self._rank]
            if _is_avg(op):
                _average([mine], self._size)
            output.copy_(mine)
        return _done(output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        self.reduce_scatter([output], [list(input.chunk(self._size))], opts)
        return _done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(output, input, opts)
        return _done(outputs)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        hosts = _hosts(tensors)
        gloo_opts = dist.ReduceOptions()
        gloo_opts.reduceOp = _gloo_op(opts.reduceOp)
        gloo_opts.rootRank = opts.rootRank
        gloo_opts.rootTensor = opts.rootTensor
        self._gloo.reduce(hosts, gloo_opts).wait()
        if self._rank == opts.rootRank:
            if _is_avg(opts.reduceOp):
                _average(hosts, self._size)
            _write_back(tensors, hosts)
        return _done(tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        host_output = _host(output)
        self._gloo.alltoall_base(
            host_output, _host(input), output_split_sizes, input_split_sizes
        ).wait()
        _write_back([output], [host_output])
        return _done([output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        outputs = _hosts(output_tensors)
        self._gloo.alltoall(outputs, _hosts(input_tensors)).wait()
        _write_back(output_tensors, outputs)
        return _done(output_tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        outputs = [_hosts(outs) for outs in output_tensors]
        gloo_opts = dist.GatherOptions()
        gloo_opts.rootRank = opts.rootRank
        self._gloo.gather(outputs, _hosts(input_tensors), gloo_opts).wait()
        for targets, hosts in zip(output_tensors, outputs, strict=True):
            _write_back(targets, hosts)
        return _done([t for outs in output_tensors for t in outs])

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        outputs = _hosts(output_tensors)
        gloo_opts = dist.ScatterOptions()
        gloo_opts.rootRank = opts.rootRank
        self._gloo.scatter(outputs, [_hosts(ins) for ins in input_tensors], gloo_opts).wait()
        _write_back(output_tensors, outputs)
        return _done(output_tensors)

    # The names torch.distributed calls in this version.

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        self._gloo.barrier().wait()
        return _done()

    def send(self, tensors, dst, tag=0):
        self._gloo.send(_hosts(tensors), dst, tag).wait()
        return _done()

    def recv(self, tensors, src, tag=0):
        hosts = _hosts(tensors)
        self._gloo.recv(hosts, src, tag).wait()
        _write_back(tensors, hosts)
        return _done(tensors)

    def recv_anysource(self, tensors, tag=0):
        hosts = _hosts(tensors)
        self._gloo.recv_anysource(hosts, tag).wait()
        _write_back(tensors, hosts)
        return _done(tensors)


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> TestCCL:
    return TestCCL(store, rank, size, timeout)


def register() -> None:
    """Make "testccl" a torch.distributed backend, the default one for testaccel."""
    global _registered
    if _registered:
        return
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create, devices=[DEVICE_TYPE, "cpu"])
    _registered = True
