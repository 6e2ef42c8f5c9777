"""`--served-model-name` without a server: which names are taken, the front's config and command
line refusing bad ones, and the launcher refusing them (exit 2) before anything starts and
passing good ones on to the front it starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitfuse.launcher.cli import main as launcher_main
from splitfuse.launcher.openai_front import OpenAIFront
from splitfuse.openai_api.__main__ import main as front_main
from splitfuse.openai_api.config import MAX_SERVED_NAME_CHARS, ApiConfig, check_served_model_name

GOOD = ["my-model", "m", "meta-llama/Llama-3.1-8B-Instruct", "org/team/model:v2@q4+lora_x",
        "a" * MAX_SERVED_NAME_CHARS]
BAD = ["", " ", "my model", "my-model\n", "tab\there", "a" * (MAX_SERVED_NAME_CHARS + 1), "/abs", "trailing/",
       "a//b", "../etc", "a/../b", "a/./b", ".", ".hidden", "a?b", "a#b", "a%2Fb", "a\\b", "modèle", "a\x00b"]


@pytest.mark.parametrize("name", GOOD)
def test_good_names_are_taken_as_they_are(name):
    assert check_served_model_name(name) == name


@pytest.mark.parametrize("name", BAD)
def test_bad_names_are_refused_naming_the_rule(name):
    with pytest.raises(ValueError, match=f"--served-model-name .* must be 1-{MAX_SERVED_NAME_CHARS} characters"):
        check_served_model_name(name)


def test_the_error_quotes_a_long_name_only_in_part():
    with pytest.raises(ValueError) as e:
        check_served_model_name("x" * 100_000)
    assert len(str(e.value)) < 2 * MAX_SERVED_NAME_CHARS + 200


def test_the_config_takes_a_good_name_refuses_a_bad_one_and_defaults_to_the_folder(tmp_path):
    model = tmp_path / "my-checkpoint"
    model.mkdir()
    assert ApiConfig(model_dir=str(model)).served_model_name == "my-checkpoint"
    assert ApiConfig(model_dir=str(model), served_model_name="org/chat").served_model_name == "org/chat"
    for bad in ("", "a b", "../x"):  # an empty name is an error, not the default
        with pytest.raises(ValueError, match="--served-model-name"):
            ApiConfig(model_dir=str(model), served_model_name=bad)
    with pytest.raises(ValueError, match="LoRA adapter name 'ad'"):
        ApiConfig(model_dir=str(model), served_model_name="ad", lora_adapters={"ad": str(tmp_path)})


def test_the_front_exits_2_on_a_bad_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        front_main(["--model", str(tmp_path), "--served-model-name", "a b"])
    assert e.value.code == 2
    assert "--served-model-name 'a b' must be" in capsys.readouterr().err


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    return folder


@pytest.mark.parametrize("extra,message", [
    (["--served-model-name", "m"], "--served-model-name needs --openai-port"),
    (["--max-logprob-entries", "10"], "--max-logprob-entries needs --openai-port"),
    (["--served-model-name", "m", "--max-logprob-entries", "10"],
     "--served-model-name and --max-logprob-entries need --openai-port"),
    (["--openai-port", "9", "--served-model-name", "a/../b"], "--served-model-name 'a/../b' must be"),
    (["--openai-port", "9", "--max-logprob-entries", "0"], "--max-logprob-entries must be positive"),
    (["--openai-port", "9", "--served-model-name", "ad", "--lora", "ad={adapter}"],
     "LoRA adapter name 'ad' is the served model's name"),
])
def test_the_launcher_refuses_bad_front_options_before_anything_starts(tmp_path, capsys, extra, message):
    adapter = _adapter(tmp_path / "adapter")
    extra = [item.format(adapter=adapter) for item in extra]
    code = launcher_main(["--model", str(tmp_path), "--model-repository-out", str(tmp_path / "repo"), *extra])
    assert code == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_the_launcher_passes_the_front_options_on_and_leaves_the_defaults_otherwise():
    plain = OpenAIFront("/m", "127.0.0.1:1", "127.0.0.1", 9000, {})
    assert "--served-model-name" not in plain.command and "--max-logprob-entries" not in plain.command
    front = OpenAIFront("/m", "127.0.0.1:1", "127.0.0.1", 9000, {}, served_model_name="org/chat",
                        max_logprob_entries=5000)
    cmd = front.command
    assert cmd[cmd.index("--served-model-name") + 1] == "org/chat"
    assert cmd[cmd.index("--max-logprob-entries") + 1] == "5000"
