"""Wrappers that make optimizers and schedulers honour accumulation and skipped steps.

`GradientState` is the small shared record between an Accelerator, the
DataLoaders it prepared (are we at the end?) and the optimizers it wrapped
(should this step really update?).
"""

from __future__ import annotations

from typing import Any

import torch

from notebook_accel.reporting.destination import milestone


class GradientState:
    """Accumulation bookkeeping shared by the Accelerator, the DataLoaders it prepared
    (are we at the end?) and the optimizers it wrapped (should this step really update?).

    As Accelerate's `GradientState`, every instance of one process shares one state:
    `GradientState()` made by user code is `accelerator.gradient_state`'s state, and a
    new Accelerator sets its accumulation settings on it. `_reset_state()` forgets it.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(
        self,
        gradient_accumulation_plugin: Any = None,
        *,
        num_steps: int | None = None,
        sync_with_dataloader: bool | None = None,
        adjust_scheduler: bool | None = None,
        sync_each_batch: bool | None = None,
    ) -> None:
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self.num_steps = 1
            self.sync_gradients = True
            # The prepared DataLoaders being iterated, innermost last.
            self.active_dataloaders = []
            # GradientAccumulationPlugin's switches
            self.sync_with_dataloader = True
            self.adjust_scheduler = True
            self.sync_each_batch = False
        given = {
            "num_steps": num_steps,
            "sync_with_dataloader": sync_with_dataloader,
            "adjust_scheduler": adjust_scheduler,
            "sync_each_batch": sync_each_batch,
        }
        if gradient_accumulation_plugin is not None:
            for name in given:
                if given[name] is None:
                    given[name] = getattr(gradient_accumulation_plugin, name, None)
        for name, value in given.items():
            if value is not None:
                setattr(self, name, value)

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state; the next instance starts from the defaults."""
        cls._shared_state.clear()

    @property
    def initialized(self) -> bool:
        """Whether the shared state exists (False before the first instance and after a reset)."""
        return bool(self._shared_state)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # An unpickled copy (a pickled Accelerator) keeps its own values.
        self.__dict__ = dict(state)

    def __repr__(self) -> str:
        return (
            f"GradientState(num_steps={self.num_steps}, sync_gradients={self.sync_gradients}, "
            f"end_of_dataloader={self.end_of_dataloader}, remainder={self.remainder})"
        )

    @property
    def active_dataloader(self) -> Any:
        """The prepared DataLoader being iterated (the innermost), or None."""
        return self.active_dataloaders[-1] if self.active_dataloaders else None

    @property
    def in_dataloader(self) -> bool:
        """True while a prepared DataLoader is being iterated."""
        return bool(self.active_dataloaders)

    @property
    def end_of_dataloader(self) -> bool:
        """True while the last batch of the innermost running DataLoader is in use."""
        return bool(self.active_dataloaders) and self.active_dataloaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the last global batch of the running DataLoader (-1: unknown)."""
        return self.active_dataloaders[-1].remainder if self.active_dataloaders else -1


class AcceleratedOptimizer(torch.optim.Optimizer):
    """An optimizer whose `step`/`zero_grad` do nothing on accumulation steps.

    Under fp16 it steps through the GradScaler, which skips the update when a
    gradient overflowed; `step_was_skipped` then says so, and the schedulers
    prepared with it do not advance.

    `platform` (the process state's) averages the gradients over the processes
    before the step where no DDP wrapper did (XLA), and ends the step (on XLA,
    a graph cut, as `xm.optimizer_step(barrier=True)` does).
    """

    # torch.optim.Optimizer.__init__ is deliberately not called: this object only forwards.
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_state: GradientState,
        scaler: torch.amp.GradScaler | None = None,
        platform: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.platform = platform
        # Whether the last step was skipped, under Accelerate's name: code (Accelerate's
        # own scheduler tests among it) sets it to say so. After a fused optimizer's
        # scaled step it is read from the device only when asked (`_found_inf`).
        self._skipped = False
        self._found_inf: torch.Tensor | None = None
        self.gradients_unscaled = False  # set by Accelerator.unscale_gradients until the step
        self.gradients_reduced = False  # set by reduce_gradients until the step
        self._stepped = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (fp16: a gradient overflowed)."""
        return self._is_overflow

    @property
    def _is_overflow(self) -> bool:
        if self._found_inf is not None:  # a fused step left the answer on the device
            self._skipped, self._found_inf = bool(self._found_inf.item()), None
        return self._skipped

    @_is_overflow.setter
    def _is_overflow(self, skipped: bool) -> None:
        self._skipped, self._found_inf = skipped, None

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            # Some optimizers' zero_grad takes no set_to_none; pass it only when given.
            if set_to_none is None:
                self.optimizer.zero_grad()
            else:
                self.optimizer.zero_grad(set_to_none=set_to_none)

    def train(self) -> None:
        """Forwarded for optimizers with train/eval modes (schedule-free)."""
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    def reduce_gradients(self) -> None:
        """Average the gradients over the processes, once per step, where DDP did not."""
        if self.platform is not None and not self.gradients_reduced:
            self.platform.reduce_gradients(self.optimizer)
            self.gradients_reduced = True

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        self.reduce_gradients()
        self.gradients_reduced = False
        if self.scaler is None:
            self._is_overflow = False
            result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        else:
            result = self._scaled_step(closure)
        if self.platform is not None:
            self.platform.end_step()
        if not self._stepped:  # what the first step imported is worth warming (launch/warm.py)
            self._stepped = True
            milestone()
        return result

    def _scaled_step(self, closure: Any) -> Any:
        # GradScaler.step calls a plain optimizer's step only when no gradient
        # overflowed, which it learns by reading the overflow flag from the device
        # (torch's own synchronisation, the same in a hand-written loop); a flag set by
        # a temporary wrapper tells us which happened. A fused optimizer (fused=True)
        # is always called, with the flag set on it as `found_inf` (torch's contract for
        # optimizers with `_step_supports_amp_scaling`), and skips on the device:
        # nothing waits, and `step_was_skipped` reads the flag only when asked (a
        # prepared scheduler asks at each step, to stay put after a skipped one).
        inner = self.optimizer
        had_own_step = "step" in vars(inner)
        original = inner.step
        stepped = False
        found_inf = None

        def flagged_step(*args: Any, **kwargs: Any) -> Any:
            nonlocal stepped, found_inf
            stepped = True
            found_inf = getattr(inner, "found_inf", None)
            return original(*args, **kwargs)

        inner.step = flagged_step
        try:
            result = (
                self.scaler.step(inner) if closure is None else self.scaler.step(inner, closure)
            )
            self.scaler.update()
        finally:
            if had_own_step:
                inner.step = original
            else:
                del inner.step
        self._is_overflow = not stepped
        if found_inf is not None:
            self._found_inf = found_inf
        self.gradients_unscaled = False
        return result

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """A learning-rate scheduler that advances only when its optimizer really stepped.

    As in Accelerate, when each process reads its own batches (no
    `split_batches`) one training step consumes `num_processes` batches, so the
    scheduler advances `num_processes` times per step; schedules written for a
    single process then end at the same point.
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        gradient_state: GradientState,
        num_processes: int = 1,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.num_processes = num_processes
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(1 if self.split_batches else self.num_processes):
            # OneCycleLR raises when stepped past its end, which the extra steps can reach.
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Everything else (last_epoch, base_lrs, ...) is the wrapped scheduler's.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
