"""Checkpoints: save_state/load_state over a TrainingObjects registry, model weights.

    training_state.py  the checkpoint directory: every process's files, written
                       atomically, checked and loaded all or nothing, also when the
                       processes save into different directories; save_model,
                       load_model_weights, latest_checkpoint
    checksums.py       CRC-32 of each file, computed while it is written

May import: config, training.
"""
