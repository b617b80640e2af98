"""The FSDP settings: the plugin's checks, its wrap policies, the YAML `fsdp:`
section, the launch option reaching `Accelerator()` in the workers, the
command line and the panel."""

from __future__ import annotations

import pytest
import torch

from notebook_accel import Accelerator, LaunchConfig, notebook_launcher
from notebook_accel.cli import main as cli_main
from notebook_accel.config.kwargs import FullyShardedDataParallelPlugin
from notebook_accel.config.settings import LaunchSettings
from notebook_accel.launch.options import ConfigError
from notebook_accel.training.fsdp import wrap_targets


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inner(x))


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_plugin_chooses_the_wrap_policy_from_what_is_given():
    assert FullyShardedDataParallelPlugin().auto_wrap_policy == "no_wrap"
    by_class = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap="Block, Attention")
    assert by_class.auto_wrap_policy == "transformer_based_wrap"
    assert by_class.transformer_cls_names_to_wrap == ["Block", "Attention"]
    assert FullyShardedDataParallelPlugin(min_num_params=10).auto_wrap_policy == "size_based_wrap"
    assert FullyShardedDataParallelPlugin(state_dict_type="full").state_dict_type == (
        "FULL_STATE_DICT"
    )


@pytest.mark.parametrize(
    "options,message",
    [
        ({"fsdp_version": 1}, "only FSDP2"),
        ({"auto_wrap_policy": "size_based_wrap"}, "needs min_num_params"),
        ({"auto_wrap_policy": "everything"}, "must be one of"),
        ({"min_num_params": 0}, "at least 1"),
        ({"cpu_offload": "yes"}, "true or false"),
        ({"state_dict_type": "LOCAL"}, "SHARDED_STATE_DICT, FULL_STATE_DICT"),
        ({"mixed_precision_policy": {"param_dtype": "fp64"}}, "must be one of bf16"),
    ],
)
def test_plugin_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        FullyShardedDataParallelPlugin(**options)


def test_wrap_policies_pick_submodules_innermost_first_and_skip_tied_ones():
    model = Tied()
    by_class = wrap_targets(
        model, FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])
    )
    assert by_class == [model.blocks[1], model.blocks[0]]
    # embed and head share a weight: neither may be a group of its own.
    by_size = wrap_targets(model, FullyShardedDataParallelPlugin(min_num_params=20))
    assert model.embed not in by_size and model.head not in by_size
    # Each Linear(4, 4) holds 20; what is left in `blocks` (two LayerNorms, 16) is too small.
    assert by_size == [model.blocks[1].inner, model.blocks[0].inner]
    by_function = wrap_targets(
        model,
        FullyShardedDataParallelPlugin(
            auto_wrap_policy=lambda m: isinstance(m, torch.nn.LayerNorm)
        ),
    )
    assert by_function == [model.blocks[1].norm, model.blocks[0].norm]
    assert wrap_targets(model, FullyShardedDataParallelPlugin()) == []
    with pytest.raises(ValueError, match="no module of class Attention.*Block"):
        wrap_targets(
            model, FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Attention"])
        )


def test_yaml_fsdp_section_round_trips_and_names_the_line_of_a_bad_option():
    text = (
        "num_processes: 2\nfsdp:\n  transformer_cls_names_to_wrap: [Block]\n  cpu_offload: true\n"
    )
    config = LaunchConfig.from_yaml(text)
    assert config.fsdp == {
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["Block"],
        "cpu_offload": True,
    }
    assert LaunchConfig.from_yaml(config.to_yaml()).fsdp == config.fsdp
    assert LaunchConfig.from_yaml("fsdp: true\n").fsdp == {}
    assert LaunchConfig.from_yaml("fsdp: null\n").fsdp is None
    with pytest.raises(ConfigError, match=r"line 4: fsdp: unknown FSDP option 'reshard'"):
        LaunchConfig.from_yaml("num_processes: 2\nfsdp:\n  min_num_params: 5\n  reshard: false\n")
    with pytest.raises(ConfigError, match=r"line 3: fsdp: cpu_offload='maybe'"):
        LaunchConfig.from_yaml("fsdp:\n  min_num_params: 5\n  cpu_offload: maybe\n")
    with pytest.raises(ConfigError, match=r"line 1: fsdp: fsdp=3 must be"):
        LaunchConfig.from_yaml("fsdp: 3\n")


def test_launch_settings_carry_fsdp_through_the_environment():
    settings = LaunchSettings("cpu", "bf16", 2, fsdp={"min_num_params": 100})
    assert LaunchSettings.from_env(settings.to_env()) == settings
    assert "NOTEBOOK_ACCEL_FSDP" not in LaunchSettings("cpu").to_env()


def test_a_bad_fsdp_launch_option_stops_before_any_worker_starts():
    with pytest.raises(ValueError, match="fsdp: unknown FSDP option 'min_params'"):
        notebook_launcher(print, num_processes=2, fsdp={"min_params": 10}, backend="cpu")
    with pytest.raises(ValueError, match="create it inside the training function"):
        notebook_launcher(
            print,
            num_processes=2,
            fsdp=FullyShardedDataParallelPlugin(auto_wrap_policy=bool),
            backend="cpu",
        )


def _what_prepare_did() -> dict:
    acc = Accelerator()
    model = torch.nn.Sequential(Block(), Block())
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return {
        "plugin": acc.fsdp_plugin.to_dict() if acc.fsdp_plugin else None,
        "model": type(model).__name__,
        "block": type(model[0]).__name__,
        "parameter": type(model[0].inner.weight).__name__,
    }


def test_yaml_fsdp_section_reaches_accelerator_in_the_workers(tmp_path):
    path = tmp_path / "launch.yaml"
    path.write_text("num_processes: 2\nfsdp:\n  transformer_cls_names_to_wrap: [Block]\n")
    result = notebook_launcher(_what_prepare_did, config=path, live=False, timeout=60)
    assert result["plugin"]["transformer_cls_names_to_wrap"] == ["Block"]
    assert (result["model"], result["block"], result["parameter"]) == (
        "FSDPSequential",
        "FSDPBlock",
        "DTensor",
    )


def test_one_process_leaves_the_model_unsharded():
    result = notebook_launcher(
        _what_prepare_did, num_processes=1, fsdp=True, live=False, backend="cpu"
    )
    assert result["plugin"] is not None
    assert (result["model"], result["parameter"]) == ("Sequential", "Parameter")


def test_cli_config_fsdp_options(tmp_path, capsys):
    path = tmp_path / "launch.yaml"
    assert (
        cli_main(
            [
                "config",
                "--file",
                str(path),
                "--fsdp-wrap-classes",
                "Block",
                "--no-fsdp-reshard-after-forward",
            ]
        )
        == 0
    )
    assert LaunchConfig.load(path).fsdp == {
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["Block"],
        "reshard_after_forward": False,
    }
    assert cli_main(["config", "--file", str(path), "--fsdp-cpu-offload"]) == 0
    assert LaunchConfig.load(path).fsdp["cpu_offload"] is True  # merged into the section
    assert cli_main(["config", "--file", str(path), "--fsdp-min-num-params", "0"]) == 2
    assert "min_num_params=0 must be at least 1" in capsys.readouterr().err
    assert cli_main(["config", "--file", str(path), "--no-fsdp"]) == 0
    assert LaunchConfig.load(path).fsdp is None


def test_panel_checkbox_turns_fsdp_on_and_keeps_a_loaded_section(tmp_path):
    from notebook_accel.ui.panel import LaunchPanel

    panel = LaunchPanel(print, config_path=str(tmp_path / "launch.yaml"))
    assert panel.choices.to_config().fsdp is None
    panel.shard.value = True
    assert panel.choices.to_config().fsdp == {}
    LaunchConfig(num_processes=2, fsdp={"min_num_params": 64}).save(tmp_path / "launch.yaml")
    panel.load_config()
    assert panel.shard.value is True
    assert panel.choices.to_config().fsdp == {
        "min_num_params": 64,
        "auto_wrap_policy": "size_based_wrap",
    }
    panel.shard.value = False
    assert panel.choices.to_config().fsdp is None


def _prepare_twice() -> str:
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = torch.nn.Linear(4, 4)
    model = acc.prepare(acc.prepare(model))
    return type(model.weight).__name__


def test_preparing_a_sharded_model_again_leaves_it_as_it_is():
    assert (
        notebook_launcher(_prepare_twice, num_processes=2, live=False, timeout=60, backend="cpu")
        == "DTensor"
    )
