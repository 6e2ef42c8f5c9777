"""Run-time LoRA loads and unloads reaching every instance of the `llm` model.

A control request (`lora_load` + `lora_path`, or `lora_unload`) lands on one instance, as any
request does; that instance applies it to its own engine (in its engine process or thread) and
answers with the result, then posts it on the control board for the other instances, which
apply it from their housekeeping thread (each its own engine), in order; one whose engine
process is restarting keeps the rest for a later pass. Instances share one config, so what one
accepted the others accept too; any other failure there is logged.

    <control dir>/<model>/lora/<tag>/<time>.json   a load or unload for the instance of <tag>
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from splitfuse.errors import UnknownLoraError
from splitfuse.engine.wire import LORA_TIMEOUT_S

log = logging.getLogger(__name__)

Op = tuple[str, str, str | None]  # ("load" | "unload", adapter name, folder or None)


class LoraAdmin:
    def __init__(self, engine, model_dir: Path, stop_dir: Path, tag: str, names: tuple[str, ...]) -> None:
        """`engine`: an EngineLoop or RemoteEngine; `stop_dir` holds one folder per instance's tag."""
        self.engine = engine
        self.board = model_dir / "lora"
        self.stop_dir, self.tag = stop_dir, tag
        self.names: tuple[str, ...] = tuple(names)
        """Adapters requests may name on this instance (configured, then loaded and unloaded)."""
        (self.board / tag).mkdir(parents=True, exist_ok=True)

    def apply(self, op: Op, post: bool = True) -> str:
        """Apply `op` to this instance's engine and, when `post`, hand it to the others. Raises
        ValueError (bad name, path or adapter, max_loras), UnknownLoraError, RuntimeError."""
        kind, name, path = op
        if kind == "load":
            self.engine.load_lora(name, path, timeout=LORA_TIMEOUT_S)
            self.names = (*self.names, name)
        else:
            self.engine.unload_lora(name, timeout=LORA_TIMEOUT_S)
            self.names = tuple(n for n in self.names if n != name)
        if post:
            self._post(op)
        return f"LoRA adapter {name!r} {kind}ed"

    def _post(self, op: Op) -> None:
        others = [p.name for p in self.stop_dir.iterdir() if p.is_dir() and p.name != self.tag]
        stamp = f"{time.time_ns():020d}.json"
        for tag in others:
            folder = self.board / tag
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{stamp}.tmp"
            tmp.write_text(json.dumps(list(op)))
            os.replace(tmp, folder / stamp)  # whole or absent for the reader

    def take_posted(self, on_error: Callable[[str], None] = log.error) -> None:
        """Apply, in order, what other instances posted to this one (housekeeping thread)."""
        folder = self.board / self.tag
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith(".")):
            path = folder / name
            try:
                op = tuple(json.loads(path.read_text()))
                self.apply(op, post=False)  # type: ignore[arg-type]
            except RuntimeError as e:
                if getattr(self.engine, "restarting", False):
                    return  # its engine process restarts after a fault: this and the rest on a later pass
                on_error(f"splitfuse: a LoRA {name} posted by another instance failed here: {e}")
            except (OSError, ValueError, UnknownLoraError) as e:
                on_error(f"splitfuse: a LoRA {name} posted by another instance failed here: {e}")
            path.unlink(missing_ok=True)
