"""What differs between torch's accelerator device types: one row per family.

The generic platform (platforms/accelerator.py) runs every device type that
torch reports through `torch.accelerator`; the little that differs between
them (the package that brings the device, the process-group backend torch
maps it to, Accelerate's `DistributedType` name, the precisions autocast
takes where the device module does not say) is data, kept here. A device type
not in the table (an out-of-tree PrivateUse1 device) gets its backend from
torch's own map and its package from the module that registered it.
"""

from __future__ import annotations

from dataclasses import dataclass

from notebook_accel.platforms.base import DistributedType


@dataclass(frozen=True)
class DeviceFamily:
    """One kind of accelerator, as torch names its device type."""

    device_type: str
    # Shown to people: "XPU", "Ascend NPU", ...
    title: str
    # The process-group backend for its tensors ("" : ask torch's map).
    backend: str = ""
    distributed_type: DistributedType = DistributedType.MULTI_GPU
    # The package that registers the device with torch ("" : torch itself).
    package: str = ""
    # The precisions autocast takes on it, where the device module cannot say.
    precisions: tuple[str, ...] = ("fp16", "bf16")
    # Whether several worker processes can share the machine's devices.
    multi_process: bool = True
    # Where to get the devices, for the message on a machine without them.
    where: str = ""


FAMILIES: dict[str, DeviceFamily] = {
    family.device_type: family
    for family in (
        DeviceFamily("cuda", "CUDA GPU", "nccl"),
        DeviceFamily("xpu", "Intel XPU", "xccl", DistributedType.MULTI_XPU),
        # PyTorch's native TPU backend (torch-tpu): a PrivateUse1 device named "tpu" that
        # torch loads through its `torch.backends` entry point; its backend ("tpu_dist")
        # comes from torch's map, where the package puts it.
        DeviceFamily(
            "tpu",
            "TPU (TorchTPU)",
            package="torch_tpu",
            precisions=("bf16",),
            where=(
                "torch-tpu runs on a TPU VM and has no CPU mode; on Colab and Kaggle TPUs "
                "backend='xla' (torch_xla) runs today"
            ),
        ),
        DeviceFamily("npu", "Ascend NPU", "hccl", DistributedType.MULTI_NPU, "torch_npu"),
        DeviceFamily("mlu", "Cambricon MLU", "cncl", DistributedType.MULTI_MLU, "torch_mlu"),
        DeviceFamily(
            "hpu", "Gaudi HPU", "hccl", DistributedType.MULTI_HPU, "habana_frameworks.torch"
        ),
        DeviceFamily(
            "musa", "Moore Threads MUSA", "mccl", DistributedType.MULTI_MUSA, "torch_musa"
        ),
        DeviceFamily("sdaa", "Tecorigin SDAA", "tccl", DistributedType.MULTI_SDAA, "torch_sdaa"),
        # Apple's GPU: one device, driven from one process (no backend moves its tensors).
        DeviceFamily("mps", "Apple MPS", "", DistributedType.NO, multi_process=False),
    )
}


def family_of(device_type: str) -> DeviceFamily:
    """The row for `device_type`; a device type not in the table gets a generic row."""
    return FAMILIES.get(device_type) or DeviceFamily(device_type, device_type)
