"""What the Accelerator prepares and what a training step runs on.

    state.py          PartialState / AcceleratorState: this process in its process group
    data.py           prepare_data_loader over sharding.py (samplers, dataset shards) and
                      loader.py (DataLoaderShard: batches on the device, its position);
                      stateful_data.py: torchdata's StatefulDataLoader
    optimizers.py     GradientState, the optimizer and scheduler wrappers
    precision.py      mixed precision (autocast, loss scaling); fp8.py: float8 layers
    fsdp.py           FSDP2 sharding and its checkpoints; compile.py: torch.compile
    ddp_buckets.py    DDP's gradient-bucket order across a resume (exact at 3+ processes);
                      ddp_teardown.py: a DDP model freed after leaving the group
    device_maps.py    models placed by a device map (dispatched, 8-bit/4-bit): kept there
    ops.py, nested.py collectives over nested tensors; helpers.py: the rest of
                      accelerate.utils' functions
    registry.py       TrainingObjects, what a checkpoint saves
    seeding.py, interrupts.py, adapters.py (peft), text.py (tokenizers), footprint.py

May import: config, platforms, reporting.
"""
