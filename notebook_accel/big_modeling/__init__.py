"""Big models: skeletons on the meta device, device maps, loading, offload and pipelines.

Accelerate's `accelerate.big_modeling` names (and the device-map helpers of
`accelerate.utils`), so code ports by changing its import:

    from notebook_accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

`import notebook_accel` does not load this subpackage; its first use does.

    meta.py        init_empty_weights, init_on_device
    memory.py      sizes of dtypes, modules and layers; max_memory; get_balanced_memory
    device_map.py  infer_auto_device_map (the same map as Accelerate's), check_device_map
    offload.py     the offload folder: memory-mapped safetensors and their index
    tensors.py     set_module_tensor_to_device, tied tensors
    hooks.py       dispatch_model, cpu_offload, disk_offload (forward hooks)
    loading.py     load_checkpoint_in_model, load_checkpoint_and_dispatch (tensor by tensor)
    pipeline.py    prepare_pippy: one pipeline stage per launched worker
"""

from __future__ import annotations

from notebook_accel.big_modeling.device_map import (
    check_device_map,
    clean_device_map,
    infer_auto_device_map,
)
from notebook_accel.big_modeling.hooks import (
    add_hook_to_module,
    cpu_offload,
    disk_offload,
    dispatch_model,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from notebook_accel.big_modeling.loading import (
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from notebook_accel.big_modeling.memory import (
    calculate_maximum_sizes,
    compute_module_sizes,
    convert_file_size_to_int,
    dtype_byte_size,
    find_tied_parameters,
    get_balanced_memory,
    get_max_layer_size,
    get_max_memory,
)
from notebook_accel.big_modeling.meta import init_empty_weights, init_on_device
from notebook_accel.big_modeling.offload import (
    OffloadedWeightsLoader,
    load_offload_index,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)
from notebook_accel.big_modeling.pipeline import prepare_pippy
from notebook_accel.big_modeling.tensors import set_module_tensor_to_device

__all__ = [
    "OffloadedWeightsLoader",
    "add_hook_to_module",
    "calculate_maximum_sizes",
    "check_device_map",
    "clean_device_map",
    "compute_module_sizes",
    "convert_file_size_to_int",
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "dtype_byte_size",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "load_offload_index",
    "offload_state_dict",
    "offload_weight",
    "prepare_pippy",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "save_offload_index",
    "set_module_tensor_to_device",
]
