"""Functional collectives and helpers under Accelerate's `accelerate.utils` names.

`from notebook_accel.utils import gather, broadcast, ...` works where a
notebook wrote `from accelerate.utils import ...`. The collectives are those of
`notebook_accel.training.ops` (nested lists, tuples and dicts of tensors; no-ops in one
process); configuration classes come from `notebook_accel.config.kwargs`. Names are
imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

from notebook_accel._lazy import lazy_exports

# The probes' names, listed here so that importing this module imports nothing.
_PROBES = (
    *(
        f"is_{name}_available"
        for name in (
            "aim amdsmi bnb 4bit_bnb 8bit_bnb bitsandbytes_multi_backend boto3 clearml comet_ml "
            "datasets deepspeed dvclive import_timer ipex lomo matplotlib megatron_lm mlflow "
            "msamp neuron pandas peft pytest pynvml rich sagemaker schedulefree swanlab "
            "tensorboard timm torchao torchdata torchvision trackio transformer_engine "
            "transformers triton wandb torch_xla torchdata_stateful_dataloader cuda xpu mps "
            "npu mlu musa sdaa hpu rocm pippy weights_only xccl bf16 fp16 fp8"
        ).split()
    ),
)

# public name -> module that defines it
_EXPORTS = {
    "gather": "notebook_accel.training.ops",
    "gather_object": "notebook_accel.training.ops",
    "broadcast": "notebook_accel.training.ops",
    "broadcast_object_list": "notebook_accel.training.ops",
    "reduce": "notebook_accel.training.ops",
    "pad_across_processes": "notebook_accel.training.ops",
    "DistributedOperationException": "notebook_accel.training.ops",
    "CannotPadNestedTensorWarning": "notebook_accel.training.ops",
    "send_to_device": "notebook_accel.training.helpers",
    "copy_tensor_to_devices": "notebook_accel.training.helpers",
    "synchronize_rng_states": "notebook_accel.training.helpers",
    "synchronize_rng_state": "notebook_accel.training.helpers",
    "wait_for_everyone": "notebook_accel.training.helpers",
    "set_seed": "notebook_accel.training.seeding",
    "DistributedType": "notebook_accel.platforms",
    "prepare_data_loader": "notebook_accel.training.data",
    "skip_first_batches": "notebook_accel.training.data",
    "SeedableRandomSampler": "notebook_accel.training.data",
    "AORecipeKwargs": "notebook_accel.config.kwargs",
    "AutocastKwargs": "notebook_accel.config.kwargs",
    "DataLoaderConfiguration": "notebook_accel.config.kwargs",
    "DistributedDataParallelKwargs": "notebook_accel.config.kwargs",
    "FullyShardedDataParallelPlugin": "notebook_accel.config.kwargs",
    "GradientAccumulationPlugin": "notebook_accel.config.kwargs",
    "GradScalerKwargs": "notebook_accel.config.kwargs",
    "InitProcessGroupKwargs": "notebook_accel.config.kwargs",
    "ProjectConfiguration": "notebook_accel.config.kwargs",
    "TorchDynamoPlugin": "notebook_accel.config.kwargs",
    "TorchContextParallelConfig": "notebook_accel.config.kwargs",
    "ProfileKwargs": "notebook_accel.config.kwargs",
    "DDPCommunicationHookType": "notebook_accel.config.kwargs",
    # finding a batch size that fits (Accelerate's accelerate.utils.memory)
    "find_executable_batch_size": "notebook_accel.accelerator.batch_size",
    "release_memory": "notebook_accel.accelerator.batch_size",
    "clear_device_cache": "notebook_accel.accelerator.batch_size",
    "should_reduce_batch_size": "notebook_accel.accelerator.batch_size",
    "LoggerType": "notebook_accel.accelerator.tracking",
    "check_os_kernel": "notebook_accel.platforms.os_kernel",
    # device maps and checkpoints for big models (Accelerate's accelerate.utils.modeling)
    "infer_auto_device_map": "notebook_accel.big_modeling.device_map",
    "check_device_map": "notebook_accel.big_modeling.device_map",
    "clean_device_map": "notebook_accel.big_modeling.device_map",
    "get_balanced_memory": "notebook_accel.big_modeling.memory",
    "get_max_memory": "notebook_accel.big_modeling.memory",
    "get_max_layer_size": "notebook_accel.big_modeling.memory",
    "compute_module_sizes": "notebook_accel.big_modeling.memory",
    "calculate_maximum_sizes": "notebook_accel.big_modeling.memory",
    "convert_file_size_to_int": "notebook_accel.big_modeling.memory",
    "dtype_byte_size": "notebook_accel.big_modeling.memory",
    "find_tied_parameters": "notebook_accel.big_modeling.memory",
    "load_checkpoint_in_model": "notebook_accel.big_modeling.loading",
    "set_module_tensor_to_device": "notebook_accel.big_modeling.tensors",
    "offload_state_dict": "notebook_accel.big_modeling.offload",
    "offload_weight": "notebook_accel.big_modeling.offload",
    "load_offload_index": "notebook_accel.big_modeling.offload",
    "save_offload_index": "notebook_accel.big_modeling.offload",
    "OffloadedWeightsLoader": "notebook_accel.big_modeling.offload",
    "named_module_tensors": "notebook_accel.big_modeling.tensors",
    "retie_parameters": "notebook_accel.big_modeling.tensors",
    "align_module_device": "notebook_accel.big_modeling.hooks",
    "has_offloaded_params": "notebook_accel.big_modeling.hooks",
    "get_state_dict_offloaded_model": "notebook_accel.big_modeling.hooks",
    "load_state_dict": "notebook_accel.big_modeling.loading",
    # Accelerate's accelerate.utils.other
    "extract_model_from_parallel": "notebook_accel.big_modeling.unwrap",
}
# is_wandb_available, is_xpu_available, ...: installed packages and present devices,
# answered without importing the package
_EXPORTS.update(dict.fromkeys(_PROBES, "notebook_accel.platforms.probes"))

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
