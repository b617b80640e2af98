"""The child's runtime, in this process: which frames a worker's traceback keeps."""

from __future__ import annotations

import functools
import re

import pytest

from notebook_accel.launch.worker import WorkerSpec, _call_user_function, _user_traceback


def user_function(value):
    return helper(value)


def helper(value):
    raise ValueError(f"bad value {value}")


class CallableTrainer:
    def __call__(self, value):
        return helper(value)


def backend_run(function, args, kwargs, local_rank, local_world_size):
    """Stands in for a backend's run_in_worker: a frame between the runtime and the user."""
    return function(*args, **kwargs)


def backend_that_fails_first(function, args, kwargs, local_rank, local_world_size):
    raise RuntimeError("the device could not be reached")


def spec_for(function, run=backend_run) -> WorkerSpec:
    return WorkerSpec(
        function=function,
        args=(7,),
        kwargs={},
        node_rank=0,
        local_world_size=1,
        environment={},
        threads_per_process=1,
        return_all=False,
        run=run,
    )


def traceback_of(spec: WorkerSpec) -> str:
    with pytest.raises(BaseException) as caught:
        _call_user_function(spec, 0)
    return _user_traceback(caught.value, spec.function)


def frames(text: str) -> list[str]:
    return re.findall(r'File ".*", line \d+, in (\S+)', text)


@pytest.mark.parametrize(
    ("function", "first_frame"),
    [
        (user_function, "user_function"),
        (functools.partial(user_function), "user_function"),
        (CallableTrainer(), "__call__"),
    ],
)
def test_the_traceback_starts_at_the_users_function(function, first_frame):
    text = traceback_of(spec_for(function))
    assert frames(text) == [first_frame, "helper"]
    assert text.rstrip().endswith("ValueError: bad value 7")


def test_a_failure_before_the_users_function_starts_below_the_runtime():
    text = traceback_of(spec_for(user_function, run=backend_that_fails_first))
    assert frames(text) == ["backend_that_fails_first"]
    assert "RuntimeError: the device could not be reached" in text
