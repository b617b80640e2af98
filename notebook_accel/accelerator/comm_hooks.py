"""DDP communication hooks: compress gradients before DDP all-reduces them.

`DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=..., comm_state_option=...)`
picks one of torch's hooks (torch.distributed.algorithms.ddp_comm_hooks);
`register` puts it on a freshly wrapped DDP model.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from notebook_accel.config.kwargs import DDPCommunicationHookType, DistributedDataParallelKwargs


def check(kwargs: DistributedDataParallelKwargs, backend: str | None) -> None:
    """Refuse a bf16 hook where torch cannot run one (it needs NCCL or XCCL), before training."""
    bf16 = DDPCommunicationHookType.BF16
    if bf16 in (kwargs.comm_hook, kwargs.comm_wrapper) and backend not in (None, "nccl", "xccl"):
        raise ValueError(
            f"bf16 gradient compression needs GPU processes (NCCL); these processes use "
            f"{backend}. Use comm_hook='fp16' (or comm_wrapper='fp16') here."
        )


def register(model: DistributedDataParallel, kwargs: DistributedDataParallelKwargs) -> None:
    """Register the hook `kwargs` names (if any) on the DDP `model`."""
    hook_type = kwargs.comm_hook
    if hook_type == DDPCommunicationHookType.NO:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    state = None  # the default hooks use the model's process group
    if hook_type == DDPCommunicationHookType.FP16:
        hook = default_hooks.fp16_compress_hook
    elif hook_type == DDPCommunicationHookType.BF16:
        hook = default_hooks.bf16_compress_hook
    else:
        state = powerSGD_hook.PowerSGDState(process_group=None, **kwargs.comm_state_option)
        hook = (
            powerSGD_hook.powerSGD_hook
            if hook_type == DDPCommunicationHookType.POWER_SGD
            else powerSGD_hook.batched_powerSGD_hook
        )
        if kwargs.comm_wrapper == DDPCommunicationHookType.FP16:
            hook = default_hooks.fp16_compress_wrapper(hook)
        elif kwargs.comm_wrapper == DDPCommunicationHookType.BF16:
            hook = default_hooks.bf16_compress_wrapper(hook)
    model.register_comm_hook(state, hook)
