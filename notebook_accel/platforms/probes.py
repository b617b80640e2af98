"""Accelerate's `is_*_available` probes: is a package installed, is a device present.

Package probes ask the import system where a package would be found
(`importlib.util.find_spec`), without importing it: asking whether wandb or
deepspeed is there must not cost their import, nor start a device runtime.
Device probes ask torch (already imported by any training code) through
calls that do not initialise a device: CUDA is counted through NVML.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

# probe name -> the import name it asks about (Accelerate's `accelerate.utils` names)
PACKAGES = {
    "aim": "aim",
    "amdsmi": "amdsmi",
    "bnb": "bitsandbytes",
    "4bit_bnb": "bitsandbytes",
    "8bit_bnb": "bitsandbytes",
    "bitsandbytes_multi_backend": "bitsandbytes",
    "boto3": "boto3",
    "clearml": "clearml",
    "comet_ml": "comet_ml",
    "datasets": "datasets",
    "deepspeed": "deepspeed",
    "dvclive": "dvclive",
    "import_timer": "import_timer",
    "ipex": "intel_extension_for_pytorch",
    "lomo": "lomo_optim",
    "matplotlib": "matplotlib",
    "megatron_lm": "megatron",
    "mlflow": "mlflow",
    "msamp": "msamp",
    "neuron": "torch_neuronx",
    "pandas": "pandas",
    "peft": "peft",
    "pytest": "pytest",
    "pynvml": "pynvml",
    "rich": "rich",
    "sagemaker": "sagemaker",
    "schedulefree": "schedulefree",
    "swanlab": "swanlab",
    "tensorboard": "tensorboard",
    "timm": "timm",
    "torchao": "torchao",
    "torchdata": "torchdata",
    "torchvision": "torchvision",
    "trackio": "trackio",
    "transformer_engine": "transformer_engine",
    "transformers": "transformers",
    "triton": "triton",
    "wandb": "wandb",
}


def package_available(name: str) -> bool:
    """Whether `import name` would find a package, found without importing it.

    Asked afresh each time (not cached): a notebook that `pip install`s a
    package after a probe said no gets yes from the next probe.
    """
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a broken spec
        return False


def _package_probe(module: str) -> Callable[[], bool]:
    def probe() -> bool:
        return package_available(module)

    probe.__doc__ = f"Whether the `{module}` package is installed (not imported to find out)."
    return probe


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla is installed (and, if asked, a TPU is present), not importing it."""
    if not package_available("torch_xla"):
        return False
    if check_is_tpu:
        from notebook_accel.platforms.registry import detect_hardware

        return detect_hardware().tpu_cores > 0
    return not check_is_gpu


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata's `StatefulDataLoader` is installed."""
    return package_available("torchdata") and package_available("torchdata.stateful_dataloader")


def is_cuda_available() -> bool:
    """Whether a CUDA GPU is usable, asked through NVML (CUDA is not initialised)."""
    if not package_available("torch"):
        return False
    import torch

    return torch.cuda.is_available()


def _torch_device_available(attribute: str, package: str | None = None) -> bool:
    """`torch.<attribute>.is_available()` where torch has that device (and its plugin package)."""
    if package is not None and not package_available(package):
        return False
    import torch

    device = getattr(torch, attribute, None)
    return bool(device is not None and device.is_available())


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel XPU is usable through torch."""
    return _torch_device_available("xpu")


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is usable."""
    import torch

    return bool(torch.backends.mps.is_available())


def is_npu_available(check_device: bool = False) -> bool:
    """Whether an Ascend NPU is usable (torch_npu)."""
    return _torch_device_available("npu", "torch_npu")


def is_mlu_available(check_device: bool = False) -> bool:
    """Whether a Cambricon MLU is usable (torch_mlu)."""
    return _torch_device_available("mlu", "torch_mlu")


def is_musa_available(check_device: bool = False) -> bool:
    """Whether a Moore Threads MUSA GPU is usable (torch_musa)."""
    return _torch_device_available("musa", "torch_musa")


def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether a Tecorigin SDAA is usable (torch_sdaa)."""
    return _torch_device_available("sdaa", "torch_sdaa")


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether a Gaudi HPU is usable (habana_frameworks)."""
    return _torch_device_available("hpu", "habana_frameworks")


def is_rocm_available() -> bool:
    """Whether this torch is a ROCm (AMD GPU) build."""
    import torch

    return torch.version.hip is not None


def is_pippy_available() -> bool:
    """Whether pipeline parallelism is there (torch.distributed.pipelining, in torch 2.4+)."""
    return package_available("torch.distributed.pipelining")


def is_weights_only_available() -> bool:
    """Whether `torch.load(weights_only=True)` exists (torch 2.4+, which this package needs)."""
    return True


def is_xccl_available() -> bool:
    """Whether torch.distributed has Intel's XCCL backend."""
    import torch.distributed as dist

    return bool(getattr(dist, "is_xccl_available", lambda: False)())


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 can be used here: on CUDA a GPU of compute capability 8.0 or more (NVML)."""
    if is_torch_xla_available(check_is_tpu=True) and not ignore_tpu:
        return True
    if is_cuda_available():
        from notebook_accel.platforms.registry import detect_hardware

        capabilities = [gpu.capability or (0, 0) for gpu in detect_hardware().gpus]
        return bool(capabilities) and min(capabilities) >= (8, 0)
    return True


def is_fp16_available() -> bool:
    """Whether fp16 mixed precision can run here (a GPU, or a CPU build of torch 2.3+)."""
    return True


def is_fp8_available() -> bool:
    """Whether fp8 training can run here: torchao and a GPU of compute capability 8.9+."""
    if not (package_available("torchao") and is_cuda_available()):
        return False
    from notebook_accel.platforms.registry import detect_hardware

    capabilities = [gpu.capability or (0, 0) for gpu in detect_hardware().gpus]
    return bool(capabilities) and min(capabilities) >= (8, 9)


# is_wandb_available, is_tensorboard_available, ... one per package
PROBES: dict[str, Callable[[], bool]] = {
    f"is_{name}_available": _package_probe(module) for name, module in PACKAGES.items()
}
globals().update(PROBES)


def is_rich_available() -> bool:
    """Whether the `rich` package is installed (not imported to find out).

    Written out, unlike the other package probes, because Accelerate exports it from its
    top level, where the API reference documents it.
    """
    return package_available("rich")


PROBES["is_rich_available"] = is_rich_available

DEVICE_PROBES = (
    "is_torch_xla_available",
    "is_torchdata_stateful_dataloader_available",
    "is_cuda_available",
    "is_xpu_available",
    "is_mps_available",
    "is_npu_available",
    "is_mlu_available",
    "is_musa_available",
    "is_sdaa_available",
    "is_hpu_available",
    "is_rocm_available",
    "is_pippy_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_bf16_available",
    "is_fp16_available",
    "is_fp8_available",
)

__all__ = ["PROBES", "package_available", *PROBES, *DEVICE_PROBES]
