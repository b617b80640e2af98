"""Prepared DataLoaders that are torchdata `StatefulDataLoader`s (`use_stateful_dataloader=True`).

Accelerate's `DataLoaderConfiguration(use_stateful_dataloader=True)` makes
every prepared loader a torchdata `StatefulDataLoader`: `isinstance(loader,
StatefulDataLoader)` holds, and `state_dict()` returns torchdata's state as of
the batch last handed out (not the one read ahead), so `load_state_dict` then
resumes the epoch right after it. `save_state`/`load_state` carry that state.

Here the prepared loader class (`DataLoaderShard`, or the platform's subclass)
is combined with `StatefulDataLoader`. torchdata's iterator reads the batches,
so its state covers what only it can restore: a dataset or sampler with its
own `state_dict` (resumed without reading the skipped data) and worker
processes (`num_workers > 0`). The prepared loader keeps doing what torchdata
does not know about: the epoch, the shuffle generator's state at the start of
the epoch (so the resumed pass draws the same order), and the random
generators as they were when the saved run read its next batch ahead. Its
`state_dict()` is torchdata's dict plus one entry, `POSITION_KEY`, with those.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from notebook_accel.config.optional import require

# The entry of a stateful loader's state_dict that holds the prepared loader's own position.
POSITION_KEY = "notebook_accel_position"
# torchdata's count of batches its iterator has yielded (single and multi-process states).
_NUM_YIELDED = "_num_yielded"


def stateful_data_loader() -> type:
    """torchdata's `StatefulDataLoader` class, or an error saying to `pip install torchdata`."""
    module = require(
        "torchdata.stateful_dataloader",
        "DataLoaderConfiguration(use_stateful_dataloader=True)",
    )
    return module.StatefulDataLoader


class _MadeAtRunTime:
    """Pickling for a loader class combined with StatefulDataLoader at run time, which
    pickle cannot find by its name: it is made again from `_made_from` (the function that
    combined it, and the class it combined), and torchdata's last iterator, which cannot
    be pickled (nor needs to be: the next pass makes one), is left out."""

    use_stateful_dataloader = True
    _made_from: tuple[Any, type]

    def __reduce_ex__(self, protocol: int) -> tuple:
        state = self.__dict__
        state = {**state, "_iterator": None} if "_iterator" in state else state
        return _remade, self._made_from, state


def _remade(combine: Any, base: type) -> Any:
    cls = combine(base)
    return cls.__new__(cls)


class _StatefulShard(_MadeAtRunTime):
    """What a prepared loader changes to be a `StatefulDataLoader` (mixed in before it)."""

    _stateful_class: type  # torchdata's StatefulDataLoader, set by stateful_loader_class

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which newer torch deprecates: a
            # warning per loader that the user can do nothing about.
            warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
            super().__init__(dataset, **kwargs)
        # torchdata's state as of the batch last handed out (None before the first).
        self._data_state: dict | None = None

    def _snapshot(self) -> None:
        # Taken after the current batch was read and before the next is read ahead,
        # so it counts exactly the batches handed out (as Accelerate's does).
        self._data_state = self._stateful_class.state_dict(self)

    def _batches(self, skip: int) -> Any:
        if self.next_iter_state is not None:
            # torchdata's iterator restores the position itself (skipping indices,
            # or a dataset's own state): the prepared loader must not skip again.
            return self._stateful_class.__iter__(self)
        return super()._batches(skip)

    def _cancel_resume(self) -> None:
        super()._cancel_resume()
        self.next_iter_state = None

    def state_dict(self) -> dict:
        """torchdata's state at the last batch handed out, and this loader's position.

        Between epochs (no batch of the current one handed out yet) torchdata's
        part is empty: the next pass starts a fresh epoch.
        """
        position = super().state_dict()
        data = dict(self._data_state or {}) if position["batches_yielded"] else {}
        return {**data, POSITION_KEY: position}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`: the next pass continues its epoch after the batches handed out.

        Also takes a state saved by a plain torchdata `StatefulDataLoader`
        (the epoch then stays as it is).
        """
        state = dict(state)
        position = state.pop(POSITION_KEY, None)
        if position is not None:
            super().load_state_dict(position)
        elif state:
            self._resume_skip = int(state.get(_NUM_YIELDED, 0))
        # After the loader's own position: set_epoch there may cancel a pending state.
        self._stateful_class.load_state_dict(self, state)
        self._data_state = state or None


def stateful_loader_class(base: type) -> type:
    """`base` (a `DataLoaderShard` class) made a torchdata `StatefulDataLoader` too."""
    return _combined(base, stateful_data_loader())  # says what to install first


@functools.cache
def _combined(base: type, stateful: type) -> type:
    return type(
        f"Stateful{base.__name__}",
        (_StatefulShard, base, stateful),
        {
            "__module__": __name__,
            "__doc__": base.__doc__,
            "_stateful_class": stateful,
            "_made_from": (stateful_loader_class, base),
        },
    )


def stateful_skip_loader_class(base: type) -> type:
    """`base` (a SkipDataLoader class) made a torchdata `StatefulDataLoader` too."""
    return _plain_combined(base, stateful_data_loader())


@functools.cache
def _plain_combined(base: type, stateful: type) -> type:
    return type(
        f"Stateful{base.__name__}",
        (_MadeAtRunTime, base, stateful),
        {
            "__module__": __name__,
            "__doc__": base.__doc__,
            "_made_from": (stateful_skip_loader_class, base),
        },
    )
