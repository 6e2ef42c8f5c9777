"""LoRA adapters loaded and unloaded while the engine serves (lora_load_dir): the same tokens as
the adapter configured at start, running requests of an unloaded adapter finish unchanged, and
every refusal names its field and leaves the engine as it was."""

import shutil

import pytest

from splitfuse import LLM, SamplingParams
from splitfuse.config import EngineConfig
from splitfuse.errors import UnknownLoraError
from splitfuse.engine.loop import EngineLoop
from test_lora_parity import ADAPTERS, _prompts, make_adapter

ENGINE = dict(dtype="float32", attention_backend="torch")


@pytest.fixture(scope="module")
def lora_dir(tiny_model_factory, tmp_path_factory):
    """(base, folder holding adapters "all" and "attn")."""
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora_runtime")
    make_adapter(base, root / "all", 1, **ADAPTERS["all"])
    make_adapter(base, root / "attn", 2, **ADAPTERS["attn"])
    return base, root


def _requests(prompts, names):
    """Every prompt with every adapter (None: the base), greedy."""
    pairs = [(i, p, name) for i, p in enumerate(prompts) for name in names]
    return ([p for _, p, _ in pairs],
            [SamplingParams(max_tokens=6 + i, temperature=0.0, lora_name=name) for i, _, name in pairs])


def _tokens(llm: LLM, names) -> list[list[int]]:
    prompts, params = _requests(_prompts(llm.engine.config.model), names)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("token_budget", [7])  # decodes stacked beside prompt chunks (grouped)
def test_loaded_at_run_time_matches_configured_at_start(lora_dir, token_budget):
    base, root = lora_dir
    names = [None, "all", "attn"]
    started = LLM(base, lora_modules=f"all={root / 'all'},attn={root / 'attn'}", token_budget=token_budget, **ENGINE)
    want = _tokens(started, names)
    assert want[1] != want[0] and want[2] != want[0], "the adapters change nothing: the test could not fail"
    llm = LLM(base, lora_load_dir=str(root), token_budget=token_budget, **ENGINE)
    assert llm.engine.lora_names() == []
    for name in ("all", "attn"):
        llm.engine.loras.load(llm.engine.loras.read(name, name))  # relative: under lora_load_dir
    assert llm.engine.lora_names() == ["all", "attn"]
    assert _tokens(llm, names) == want


def test_unload_while_running_finishes_unchanged_then_refuses(lora_dir):
    base, root = lora_dir
    llm = LLM(base, lora_load_dir=str(root), **ENGINE)
    engine = llm.engine
    engine.loras.load(engine.loras.read("all", str(root / "all")))
    prompt, params = _prompts(base)[3], SamplingParams(max_tokens=12, temperature=0.0, lora_name="all")
    want = llm.generate([prompt], [params])[0].token_ids
    engine.add_request("r", prompt, params)
    outs = engine.step() + engine.step()  # prompt done, decoding
    assert outs and not outs[-1].finished
    engine.unload_lora("all")
    assert engine.lora_names() == [] and engine.lora_stats().configured == ["all"]  # still in memory
    with pytest.raises(ValueError, match="unknown LoRA adapter 'all'"):
        engine.add_request("late", prompt, params)
    with pytest.raises(ValueError, match="'all' is still unloading"):
        engine.loras.load(engine.loras.read("all", "all"))
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].token_ids == want
    assert engine.lora_stats().configured == [] and engine.lora_stats().resident == []
    engine.loras.load(engine.loras.read("all", "all"))  # same weights, same name: served again
    assert llm.generate([prompt], [params])[0].token_ids == want
    engine.check_invariants()


def test_refusals_name_the_field_and_change_nothing(lora_dir, tmp_path):
    base, root = lora_dir
    llm = LLM(base, lora_load_dir=str(root), max_loras=1, **ENGINE)
    loras = llm.engine.loras
    with pytest.raises(ValueError, match="lora_path: .* is outside"):
        loras.read("x", str(tmp_path))
    with pytest.raises(ValueError, match="lora_path: .* is outside"):
        loras.read("x", "../" + tmp_path.name)
    with pytest.raises(ValueError, match="lora_path: 'nope' is not a folder"):
        loras.read("x", "nope")
    with pytest.raises(ValueError, match="lora_name: 'a b'"):
        loras.read("a b", "all")
    broken = root / "broken"
    shutil.copytree(root / "attn", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot read it as safetensors"):
        loras.read("broken", "broken")
    shutil.rmtree(broken)
    loras.load(loras.read("all", "all"))
    with pytest.raises(ValueError, match="max_loras=1"):
        loras.load(loras.read("attn", "attn"))
    with pytest.raises(ValueError, match="'all' is already loaded"):
        loras.load(loras.read("all", "all"))
    with pytest.raises(UnknownLoraError, match="unknown LoRA adapter 'attn'"):
        llm.engine.unload_lora("attn")
    assert llm.engine.lora_names() == ["all"]
    llm.engine.unload_lora("all")
    with pytest.raises(ValueError, match="'all' served other weights"):
        loras.load(loras.read("all", "attn"))
    no_dir = LLM(base, **ENGINE)
    with pytest.raises(ValueError, match="no lora_load_dir"):
        no_dir.engine.loras.read("all", str(root / "all"))


def test_engine_loop_loads_and_unloads_between_steps(lora_dir):
    base, root = lora_dir
    loop = EngineLoop(EngineConfig(model=base, lora_load_dir=str(root), **ENGINE))
    loop.start()
    try:
        loop.load_lora("attn", "attn", timeout=60)
        assert loop.engine.lora_names() == ["attn"]
        with pytest.raises(ValueError, match="already loaded"):
            loop.load_lora("attn", "attn", timeout=60)
        loop.unload_lora("attn", timeout=60)
        with pytest.raises(UnknownLoraError):
            loop.unload_lora("attn", timeout=60)
        assert loop.engine.lora_names() == []
    finally:
        loop.shutdown(timeout=30)


def test_lora_load_dir_checked_at_start(tmp_path):
    with pytest.raises(ValueError, match="lora_load_dir: .* is not a folder"):
        EngineConfig(model="/m", lora_load_dir=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="lora_load_dir: lora_modules already names max_loras=1"):
        EngineConfig(model="/m", lora_load_dir=str(tmp_path), lora_modules="a=/x", max_loras=1)
    with pytest.raises(ValueError, match="lora_load_dir cannot be combined with tensor_parallel_size"):
        EngineConfig(model="/m", lora_load_dir=str(tmp_path), tensor_parallel_size=2)


def test_a_load_posted_by_one_instance_is_applied_by_the_other(lora_dir, tmp_path):
    """Two `llm` instances' admins over one control board, each with its own engine."""
    from splitfuse.triton_server.lora_admin import LoraAdmin

    base, root = lora_dir
    stops = tmp_path / "stop"
    loops = [EngineLoop(EngineConfig(model=base, lora_load_dir=str(root), **ENGINE)) for _ in range(2)]
    admins = []
    for tag, loop in zip(("a", "b"), loops):
        loop.start()
        (stops / tag).mkdir(parents=True)
        admins.append(LoraAdmin(loop, tmp_path, stops, tag, ()))
    try:
        assert admins[0].apply(("load", "attn", "attn")) == "LoRA adapter 'attn' loaded"
        assert loops[1].engine.lora_names() == []  # not yet: on its next housekeeping pass
        errors = []
        admins[1].take_posted(errors.append)
        assert errors == [] and admins[1].names == ("attn",) and loops[1].engine.lora_names() == ["attn"]
        with pytest.raises(UnknownLoraError):
            admins[0].apply(("unload", "nope", None))
        admins[0].apply(("unload", "attn", None))
        admins[1].take_posted(errors.append)
        assert errors == [] and admins[1].names == () and loops[1].engine.lora_names() == []
        admins[1].take_posted(errors.append)  # each post is applied once
        assert errors == []
    finally:
        for loop in loops:
            loop.shutdown(timeout=30)


@pytest.mark.slow  # two engine processes started (~15 s on 2 cores); the served tests load through one
def test_engine_process_loads_unloads_and_loads_again_after_a_restart(lora_dir):
    """RemoteEngine (engine_process): the same tokens as in-process; a child killed and restarted
    serves the adapters its predecessor had loaded."""
    import os
    import signal
    import threading
    import time

    from splitfuse.engine.remote import RemoteEngine

    base, root = lora_dir
    config = EngineConfig(model=base, lora_load_dir=str(root), **ENGINE)
    prompt, params = _prompts(base)[2], SamplingParams(max_tokens=8, temperature=0.0, lora_name="attn")
    local = LLM(base, lora_load_dir=str(root), **ENGINE)
    local.engine.loras.load(local.engine.loras.read("attn", "attn"))
    want = local.generate([prompt], [params])[0].token_ids

    def generate(remote, request_id: str) -> list[int]:
        done, outs = threading.Event(), []
        remote.submit(request_id, prompt, params, lambda out: (outs.append(out), out.finished and done.set()))
        assert done.wait(60)
        return outs[-1].token_ids

    remote = RemoteEngine(config, name="test")
    first = remote.start()
    try:
        with pytest.raises(ValueError, match="lora_path"):
            remote.load_lora("attn", "/", timeout=60)
        remote.load_lora("attn", "attn", timeout=60)
        assert generate(remote, "a") == want
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (remote.restarting or remote.facts.pid == first.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        for attempt in range(100):  # the new child loads it again right after its start
            try:
                assert generate(remote, f"b{attempt}") == want
                break
            except ValueError:
                time.sleep(0.05)
        else:
            pytest.fail("the restarted engine process does not serve the adapter loaded before")
        remote.unload_lora("attn", timeout=60)
        with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
            generate(remote, "c")
        with pytest.raises(UnknownLoraError):
            remote.unload_lora("attn", timeout=60)
    finally:
        remote.shutdown(30)
