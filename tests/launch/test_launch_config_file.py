"""The launch configuration file: written, read back, and checked with line numbers."""

from __future__ import annotations

import pytest

from notebook_accel import LaunchConfig, last_run, notebook_launcher
from notebook_accel.launch.options import ConfigError


def test_round_trip(tmp_path):
    config = LaunchConfig(
        backend="cpu",
        num_processes=3,
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
        timeout=30.0,
    )
    path = tmp_path / "launch.yaml"
    config.save(path)
    assert LaunchConfig.load(path) == config
    assert path.read_text().startswith("# notebook_accel launch configuration")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "backend: cpu\nnum_procs: 2\n",
            r"line 2: unknown key 'num_procs'; did you mean 'num_processes'",
        ),
        ("num_processes: 0\n", "line 1: num_processes=0 must be at least 1"),
        (
            "backend: cpu\n\nmixed_precision: fp64\n",
            "line 3: mixed_precision='fp64' is not a precision",
        ),
        ("use_port: 99999\n", "line 1: use_port=99999 must be between 1 and 65535"),
        ("- cpu\n", "must be a mapping"),
        ("backend: [cpu\n", "is not valid YAML"),
    ],
)
def test_bad_files_name_the_key_and_line(text, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig.from_yaml(text, source="launch.yaml")


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no launch configuration at"):
        LaunchConfig.load(tmp_path / "nope.yaml")


def report_precision():
    from notebook_accel.config.settings import LaunchSettings

    return LaunchSettings.from_env()


def test_notebook_launcher_takes_the_file_and_explicit_options_win(tmp_path):
    path = tmp_path / "launch.yaml"
    LaunchConfig(
        backend="cpu", num_processes=2, mixed_precision="bf16", gradient_accumulation_steps=3
    ).save(path)
    settings = notebook_launcher(report_precision, config=str(path))
    assert (settings.mixed_precision, settings.gradient_accumulation_steps) == ("bf16", 3)
    assert last_run().world_size == 2
    settings = notebook_launcher(report_precision, config=str(path), mixed_precision="fp16")
    assert settings.mixed_precision == "fp16"


def test_an_explicit_value_equal_to_the_default_still_beats_the_file(tmp_path):
    """mixed_precision="no" is the default, and it was passed: the file's bf16 must lose."""
    path = tmp_path / "bf16.yaml"
    LaunchConfig(backend="cpu", num_processes=2, mixed_precision="bf16").save(path)
    settings = notebook_launcher(report_precision, config=str(path), mixed_precision="no")
    assert settings.mixed_precision == "no"
    settings = notebook_launcher(report_precision, config=str(path), num_processes=1)
    assert settings.mixed_precision == "bf16" and last_run().world_size == 1


def test_accelerate_s_positional_options_still_work():
    # notebook_launcher(function, args, num_processes, mixed_precision, use_port, ...)
    settings = notebook_launcher(report_precision, (), 1, "bf16", backend="cpu")
    assert settings.mixed_precision == "bf16" and last_run().world_size == 1
    with pytest.raises(TypeError, match="got option 'num_processes' twice"):
        notebook_launcher(report_precision, (), 1, num_processes=2, backend="cpu")
    with pytest.raises(TypeError, match="at most 8 positional arguments"):
        notebook_launcher(report_precision, (), 1, "no", None, "127.0.0.1", 0, 1, "extra")


def test_every_option_is_shown_in_the_signature_and_the_docstring():
    import inspect

    from notebook_accel.launch.options import OPTIONS, SAVED_OPTIONS

    shown = inspect.signature(notebook_launcher).parameters
    for name, option in OPTIONS.items():
        assert shown[name].default == option.default, name
        assert f"    {name} (default" in notebook_launcher.__doc__, name
    assert set(SAVED_OPTIONS) == {f.name for f in __import__("dataclasses").fields(LaunchConfig)}
