"""What a run is made of, in the order it was prepared: what a checkpoint saves.

The `Accelerator` owns one `TrainingObjects`. `prepare` adds models,
optimizers, schedulers and DataLoaders to it, `register_for_checkpointing`
adds the user's own objects, and training advances its step counter.
`notebook_accel.checkpoint.training_state` saves and restores exactly what it holds; the
position of an object in its list is the number of its file in a checkpoint
(`model.safetensors`, `model_1.safetensors`, ...), so a run that resumes must
add the same objects in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from notebook_accel.training.loader import DataLoaderShard
    from notebook_accel.training.optimizers import AcceleratedOptimizer, AcceleratedScheduler

# The kinds of object a checkpoint counts, by the names its manifest uses.
KINDS = ("models", "optimizers", "schedulers", "custom_objects", "dataloaders")


@dataclass
class TrainingObjects:
    """The models, optimizers, schedulers, DataLoaders and registered objects of a run.

    Also the fp16 loss scaler (None outside fp16) and the step counter of
    `Accelerator.accumulate`, which a checkpoint saves too.
    """

    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[AcceleratedOptimizer] = field(default_factory=list)
    schedulers: list[AcceleratedScheduler] = field(default_factory=list)
    dataloaders: list[DataLoaderShard] = field(default_factory=list)
    custom_objects: list[Any] = field(default_factory=list)
    scaler: torch.amp.GradScaler | None = None
    step: int = 0

    def register(self, *objects: Any) -> None:
        """Add user objects to save; each needs `state_dict()` and `load_state_dict()`.

        Nothing is added when one of them lacks the methods: one ValueError names
        every such item by its position, as Accelerate's does.
        """
        invalid = [
            f"- Item at index {index}, `{type(obj).__name__}`"
            for index, obj in enumerate(objects)
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            )
        ]
        if invalid:
            raise ValueError(
                "register_for_checkpointing needs objects with state_dict() and "
                "load_state_dict() methods (prepare models, optimizers and schedulers instead, "
                "or wrap other values in such an object). These have not:\n" + "\n".join(invalid)
            )
        self.custom_objects.extend(objects)

    def counts(self) -> dict[str, int]:
        """How many objects of each kind there are, keyed as in a checkpoint's manifest."""
        return {kind: len(getattr(self, kind)) for kind in KINDS}

    def clear(self) -> None:
        """Forget every object and reset the step counter.

        The scaler stays: it belongs to the precision setting, not to what was prepared.
        """
        for kind in KINDS:
            getattr(self, kind).clear()
        self.step = 0
