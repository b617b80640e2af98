"""Big models: skeletons on the meta device, device maps, loading, offload and pipelines.

Accelerate's `accelerate.big_modeling` names (and the device-map helpers of
`accelerate.utils`), so code ports by changing its import:

    from notebook_accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

`import notebook_accel` does not load this subpackage; its first use does.

    meta.py        init_empty_weights, init_on_device
    memory.py      sizes of dtypes, modules, buffers and layers; max_memory; get_balanced_memory
    device_map.py  infer_auto_device_map (the same map as Accelerate's), check_device_map
    offload.py     the offload folder: memory-mapped safetensors and their index
    tensors.py     set_module_tensor_to_device, named_module_tensors, tied tensors
    hooks.py       hooks around a forward, removed with what they changed put back;
                   align_module_device, get_state_dict_offloaded_model
    dispatch.py    dispatch_model, cpu_offload, disk_offload, cpu_offload_with_hook,
                   attach_align_device_hook
    loading.py     load_checkpoint_in_model, load_checkpoint_and_dispatch (tensor by tensor)
    pipeline.py    prepare_pippy: one pipeline stage per launched worker
    unwrap.py      extract_model_from_parallel

May import: training, platforms (what a device index means).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from notebook_accel._lazy import lazy_exports

# public name -> module that defines it (imported on first use: see _lazy.py)
_EXPORTS = {
    "check_device_map": "notebook_accel.big_modeling.device_map",
    "clean_device_map": "notebook_accel.big_modeling.device_map",
    "get_module_size_with_ties": "notebook_accel.big_modeling.device_map",
    "infer_auto_device_map": "notebook_accel.big_modeling.device_map",
    "UserCpuOffloadHook": "notebook_accel.big_modeling.dispatch",
    "attach_align_device_hook": "notebook_accel.big_modeling.dispatch",
    "cpu_offload": "notebook_accel.big_modeling.dispatch",
    "cpu_offload_with_hook": "notebook_accel.big_modeling.dispatch",
    "disk_offload": "notebook_accel.big_modeling.dispatch",
    "dispatch_model": "notebook_accel.big_modeling.dispatch",
    "add_hook_to_module": "notebook_accel.big_modeling.hooks",
    "align_module_device": "notebook_accel.big_modeling.hooks",
    "get_state_dict_offloaded_model": "notebook_accel.big_modeling.hooks",
    "has_offloaded_params": "notebook_accel.big_modeling.hooks",
    "remove_hook_from_module": "notebook_accel.big_modeling.hooks",
    "remove_hook_from_submodules": "notebook_accel.big_modeling.hooks",
    "load_checkpoint_and_dispatch": "notebook_accel.big_modeling.loading",
    "load_checkpoint_in_model": "notebook_accel.big_modeling.loading",
    "load_state_dict": "notebook_accel.big_modeling.loading",
    "calculate_maximum_sizes": "notebook_accel.big_modeling.memory",
    "compute_module_sizes": "notebook_accel.big_modeling.memory",
    "compute_module_total_buffer_size": "notebook_accel.big_modeling.memory",
    "convert_file_size_to_int": "notebook_accel.big_modeling.memory",
    "dtype_byte_size": "notebook_accel.big_modeling.memory",
    "find_tied_parameters": "notebook_accel.big_modeling.memory",
    "get_balanced_memory": "notebook_accel.big_modeling.memory",
    "get_max_layer_size": "notebook_accel.big_modeling.memory",
    "get_max_memory": "notebook_accel.big_modeling.memory",
    "init_empty_weights": "notebook_accel.big_modeling.meta",
    "init_on_device": "notebook_accel.big_modeling.meta",
    "OffloadedWeightsLoader": "notebook_accel.big_modeling.offload",
    "load_offload_index": "notebook_accel.big_modeling.offload",
    "offload_state_dict": "notebook_accel.big_modeling.offload",
    "offload_weight": "notebook_accel.big_modeling.offload",
    "save_offload_index": "notebook_accel.big_modeling.offload",
    "prepare_pippy": "notebook_accel.big_modeling.pipeline",
    "get_non_persistent_buffers": "notebook_accel.big_modeling.tensors",
    "named_module_tensors": "notebook_accel.big_modeling.tensors",
    "retie_parameters": "notebook_accel.big_modeling.tensors",
    "set_module_tensor_to_device": "notebook_accel.big_modeling.tensors",
    "extract_model_from_parallel": "notebook_accel.big_modeling.unwrap",
}

if TYPE_CHECKING:
    from notebook_accel.big_modeling.device_map import (
        check_device_map,
        clean_device_map,
        get_module_size_with_ties,
        infer_auto_device_map,
    )
    from notebook_accel.big_modeling.dispatch import (
        UserCpuOffloadHook,
        attach_align_device_hook,
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
    )
    from notebook_accel.big_modeling.hooks import (
        add_hook_to_module,
        align_module_device,
        get_state_dict_offloaded_model,
        has_offloaded_params,
        remove_hook_from_module,
        remove_hook_from_submodules,
    )
    from notebook_accel.big_modeling.loading import (
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
        load_state_dict,
    )
    from notebook_accel.big_modeling.memory import (
        calculate_maximum_sizes,
        compute_module_sizes,
        compute_module_total_buffer_size,
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
    from notebook_accel.big_modeling.tensors import (
        get_non_persistent_buffers,
        named_module_tensors,
        retie_parameters,
        set_module_tensor_to_device,
    )
    from notebook_accel.big_modeling.unwrap import extract_model_from_parallel

__all__ = [
    "OffloadedWeightsLoader",
    "UserCpuOffloadHook",
    "add_hook_to_module",
    "align_module_device",
    "attach_align_device_hook",
    "calculate_maximum_sizes",
    "check_device_map",
    "clean_device_map",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "convert_file_size_to_int",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "dtype_byte_size",
    "extract_model_from_parallel",
    "find_tied_parameters",
    "get_balanced_memory",
    "get_max_layer_size",
    "get_max_memory",
    "get_module_size_with_ties",
    "get_non_persistent_buffers",
    "get_state_dict_offloaded_model",
    "has_offloaded_params",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "load_offload_index",
    "load_state_dict",
    "named_module_tensors",
    "offload_state_dict",
    "offload_weight",
    "prepare_pippy",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "retie_parameters",
    "save_offload_index",
    "set_module_tensor_to_device",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
