import pytest

from splitfuse.config import EngineConfig, ServerConfig, split_parameters


def test_from_strings_converts_by_field_type():
    c = EngineConfig.from_strings({"model": "/m", "token_budget": "256", "num_kv_blocks": "", "kv_cache_memory_gb": "0.5",
                                   "scheduler_policy": "orca"})
    assert c.token_budget == 256 and c.num_kv_blocks is None and c.kv_cache_memory_gb == 0.5
    assert c.scheduler_policy == "orca" and c.tokenizer == "/m"


def test_prefix_caching_is_on_by_default_and_parsed_as_a_bool():
    assert EngineConfig(model="/m").enable_prefix_caching is True
    for raw, value in [("false", False), ("0", False), ("off", False), ("true", True), ("1", True), ("", True)]:
        values = {"model": "/m", "enable_prefix_caching": raw} if raw else {"model": "/m"}
        assert EngineConfig.from_strings(values).enable_prefix_caching is value


@pytest.mark.parametrize("values,field", [
    ({"model": "/m", "enable_prefix_caching": "maybe"}, "enable_prefix_caching"),
    ({"model": "/m", "token_budgt": "1"}, "token_budgt"),
    ({"model": "/m", "token_budget": "many"}, "token_budget"),
    ({"model": "/m", "token_budget": "0"}, "token_budget"),
    ({"model": "/m", "block_size": "-4"}, "block_size"),
    ({"model": "/m", "attention_backend": "cudnn"}, "attention_backend"),
    ({"model": "/m", "scheduler_policy": "fifo"}, "scheduler_policy"),
    ({"model": "/m", "dtype": "int8"}, "dtype"),
    ({"model": "/m", "kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"model": "/m", "kv_watermark": "1.5"}, "kv_watermark"),
    ({"model": "/m", "first_token_deadline_tokens_per_s": "0"}, "first_token_deadline_tokens_per_s"),
    ({"model": "/m", "prompt_order": "sjf"}, "prompt_order"),
    ({"model": "/m", "prompt_order": "goodput", "scheduler_policy": "orca"}, "prompt_order"),
])
def test_bad_values_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_strings(values)


def test_every_field_is_a_known_name():
    names = EngineConfig.field_names()
    assert names[0] == "model" and "token_budget" in names and "scheduler_policy" in names


@pytest.mark.parametrize("values,field", [
    ({"default_temperature": "-0.5"}, "default_temperature"),
    ({"default_temperature": "nan"}, "default_temperature"),
    ({"stream_interval": "0"}, "stream_interval"),
    ({"max_waiting_requests": "-1"}, "max_waiting_requests"),
    ({"replica_balance_max_wait_ms": "-1"}, "replica_balance_max_wait_ms"),
    ({"step_timeout_s": "0"}, "step_timeout_s"),
    ({"engine_restarts": "-1"}, "engine_restarts"),
    ({"engine_restart_window_s": "inf"}, "engine_restart_window_s"),
    ({"engine_memory_limit_bytes": "-1"}, "engine_memory_limit_bytes"),
    ({"engine_process": "maybe"}, "engine_process"),
])
def test_bad_server_values_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        split_parameters({"model": "/m", **values})


def test_the_engine_process_settings_parse():
    server = split_parameters({"model": "/m", "engine_process": "false", "step_timeout_s": "2.5",
                               "engine_restarts": "0", "engine_memory_limit_bytes": str(4 << 30)})[1]
    assert (server.engine_process, server.step_timeout_s, server.engine_restarts) == (False, 2.5, 0)
    assert server.engine_memory_limit_bytes == 4 << 30 and ServerConfig().engine_process is True


def test_default_temperature_is_greedy_and_parsed():
    assert ServerConfig().default_temperature == 0.0
    assert split_parameters({"model": "/m", "default_temperature": "1.0"})[1].default_temperature == 1.0


def test_parameters_split_one_to_one_and_unknown_names_fail():
    engine, server = split_parameters({"model": "/m", "token_budget": "64", "stream_interval": "2"})
    assert (engine.token_budget, server.stream_interval) == (64, 2)
    assert not set(EngineConfig.field_names()) & set(ServerConfig.field_names())
    with pytest.raises(ValueError, match="unknown engine parameter.*stream_intervall"):
        split_parameters({"model": "/m", "stream_intervall": "2"})
    with pytest.raises(TypeError, match="stream_interval"):  # a server setting is not an engine knob
        EngineConfig(model="/m", stream_interval=2)
