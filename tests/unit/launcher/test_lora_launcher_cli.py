"""LoRA on the serving side without a server: the launcher's `--lora NAME=PATH` (folders made
absolute, bad ones refused with exit 2 before anything starts) and the `lora_name` input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from splitfuse.launcher.cli import main
from splitfuse.launcher.lora import lora_params, resolve_lora_modules
from splitfuse.inputs import InputError
from splitfuse.triton_server.request import parse_request


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    return folder


def test_lora_flags_become_lora_modules_with_absolute_folders(tmp_path, monkeypatch):
    _adapter(tmp_path / "ad" / "a")
    _adapter(tmp_path / "b")
    monkeypatch.chdir(tmp_path / "ad")
    params = lora_params({"token_budget": "64"}, ["a=a", f"b={tmp_path / 'b'}"])
    assert params == {"token_budget": "64", "lora_modules": f"a={tmp_path / 'ad' / 'a'},b={tmp_path / 'b'}"}
    # --param lora_modules=... is resolved the same way; nothing given: nothing added.
    assert lora_params({"lora_modules": "a=a"}, []) == {"lora_modules": f"a={tmp_path / 'ad' / 'a'}"}
    assert lora_params({"seed": "1"}, []) == {"seed": "1"}


@pytest.mark.parametrize("items,params,message", [
    (["a"], {}, "--lora expects NAME=PATH"),
    (["=x"], {}, "--lora expects NAME=PATH"),
    (["a=missing"], {}, "folder missing does not exist"),
    (["a=plain"], {}, "has no adapter_config.json"),
    (["a=ok", "a=ok"], {}, "'a' is given twice"),
    (["a=ok"], {"lora_modules": "b=ok"}, "not both"),
    ([], {"lora_modules": "a=missing"}, "lora_modules: LoRA adapter 'a': folder missing does not exist"),
    ([], {"lora_modules": "bad name=ok"}, "adapter name 'bad name'"),
])
def test_bad_lora_arguments_are_refused_naming_the_problem(tmp_path, monkeypatch, items, params, message):
    _adapter(tmp_path / "ok")
    (tmp_path / "plain").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        lora_params(params, items)


def test_the_launcher_exits_2_on_a_missing_adapter_folder(tmp_path, capsys):
    code = main(["--model", str(tmp_path), "--lora", f"a={tmp_path / 'nowhere'}", "--render-only",
                 "--model-repository-out", str(tmp_path / "repo")])
    assert code == 2
    err = capsys.readouterr().err
    assert "error: --lora: LoRA adapter 'a': folder" in err and "nowhere does not exist" in err
    assert not (tmp_path / "repo").exists()


def test_a_path_with_a_comma_cannot_be_a_lora_module(tmp_path):
    _adapter(tmp_path / "x,y")
    with pytest.raises(ValueError, match="contains ',' or '='"):
        lora_params({}, [f"a={tmp_path / 'x,y'}"])
    assert resolve_lora_modules("") == {}


def _request(**extra) -> dict:
    values = {"input_ids": np.array([[1, 2, 3]], dtype=np.int32), "max_tokens": np.array([[4]], dtype=np.int32)}
    values.update({k: np.array([[v.encode()]], dtype=np.object_) for k, v in extra.items()})
    return values


def test_lora_name_input_reaches_sampling_params():
    assert parse_request(_request(lora_name="sql")).params.lora_name == "sql"
    assert parse_request(_request()).params.lora_name is None
    with pytest.raises(InputError, match="lora_name is empty"):
        parse_request(_request(lora_name=""))


def test_the_openai_front_is_told_the_adapters(tmp_path, monkeypatch):
    from splitfuse.launcher.openai_front import OpenAIFront
    from splitfuse.openai_api.config import ApiConfig

    _adapter(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    front = OpenAIFront("m", "127.0.0.1:1", "127.0.0.1", 9000, {"lora_modules": "a=a"})
    flags = front.command[front.command.index("--lora"):][:2]
    assert flags == ["--lora", f"a={tmp_path / 'a'}"]
    assert "--lora" not in OpenAIFront("m", "127.0.0.1:1", "127.0.0.1", 9000, {}).command
    assert "--allow-runtime-lora" in OpenAIFront("m", "127.0.0.1:1", "127.0.0.1", 9000, {},
                                                 allow_runtime_lora=True).command
    assert "--allow-runtime-lora" not in OpenAIFront("m", "127.0.0.1:1", "127.0.0.1", 9000, {}).command
    (tmp_path / "base").mkdir()
    with pytest.raises(ValueError, match="served model's name"):
        ApiConfig(model_dir=str(tmp_path / "base"), lora_adapters={"base": str(tmp_path / "a")})


def test_the_llm_template_has_a_parameter_for_every_engine_field():
    """config.pbtxt parameters map one to one onto EngineConfig fields (lora_modules, max_loras and
    max_lora_rank included)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from splitfuse.config import EngineConfig, parameter_names
    from splitfuse.launcher.repository import default_template_dir

    text = (default_template_dir() / "llm" / "config.pbtxt").read_text()
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert sorted(cfg.parameters) == sorted(parameter_names())  # every parameter, each once
    defaults = EngineConfig(model="/m")
    for name in ("lora_modules", "max_loras", "max_lora_rank"):  # the template's values are the defaults
        assert cfg.parameters[name].string_value == str(getattr(defaults, name))
