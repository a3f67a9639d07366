"""Truncated checkpoints: the first L layers, the norm and the head, loadable and equal to the identity exit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from exitplan.earlyexit.partial_model import EarlyExitLM
from exitplan.errors import ExitplanError
from exitplan.vllm.truncate import partial_name, truncate


def test_the_cut_keeps_the_first_layers_the_norm_and_the_head(tiny_checkpoint, tmp_path_factory) -> None:
    path, _ = tiny_checkpoint
    tmp_path = tmp_path_factory.mktemp("out")
    source = json.loads((path / "config.json").read_text())
    out = truncate(path, tmp_path / partial_name("org/tiny", 2), 2, dtype="bfloat16")
    assert out.name == "tiny-L2" and out.parent.name == "org"
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["dtype"] == "bfloat16"
    assert {k: v for k, v in config.items() if k not in ("num_hidden_layers", "dtype", "torch_dtype",
                                                          "layer_types", "max_window_layers")} == \
        {k: v for k, v in source.items() if k not in ("num_hidden_layers", "dtype", "torch_dtype", "layer_types",
                                                      "max_window_layers")}
    tensors = load_file(str(out / "model.safetensors"))
    layers = {int(n.split("layers.")[1].split(".")[0]) for n in tensors if "layers." in n}
    assert layers == {0, 1} and all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert any(n.endswith("norm.weight") and "layers" not in n for n in tensors)
    assert not list(tmp_path.glob("org/.*"))  # no scratch left


def test_the_cut_model_is_the_identity_exit_of_the_whole_one(tiny_checkpoint, tmp_path_factory) -> None:
    path, _ = tiny_checkpoint
    tmp_path = tmp_path_factory.mktemp("out")
    out = truncate(path, tmp_path / "cut", 3)
    full, cut = EarlyExitLM.from_pretrained(path), EarlyExitLM.from_pretrained(out)
    ids = torch.tensor([[5, 17, 230, 99, 4, 1000, 7]])
    with torch.no_grad():
        expected = full.exit_logits(full.layer_outputs(ids)[2], 3)
        got = cut.model(input_ids=ids).logits
    assert cut.num_layers == 3
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_cut_outside_the_model_is_refused_and_writes_nothing(tiny_checkpoint, tmp_path_factory) -> None:
    path, _ = tiny_checkpoint
    tmp_path = tmp_path_factory.mktemp("out")
    for layers in (0, 99):
        with pytest.raises(ExitplanError, match=f"cannot keep {layers}"):
            truncate(path, tmp_path / "cut", layers)
    assert not list(tmp_path.iterdir())


def test_the_truncate_command_cuts_and_names_a_bad_dtype(tiny_checkpoint, tmp_path_factory) -> None:
    from typer.testing import CliRunner

    from exitplan.cli import app

    path, _ = tiny_checkpoint
    out = tmp_path_factory.mktemp("cmd") / "cut"
    runner = CliRunner()
    bad = runner.invoke(app, ["truncate", str(path), str(out), "--layers", "2", "--dtype", "int8"])
    assert isinstance(bad.exception, ExitplanError) and "--dtype must be" in str(bad.exception)
    assert not out.exists()
    good = runner.invoke(app, ["truncate", str(path), str(out), "--layers", "2", "--dtype", "bfloat16"])
    assert good.exit_code == 0, good.output
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "bfloat16"
