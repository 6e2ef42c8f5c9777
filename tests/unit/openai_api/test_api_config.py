"""ApiConfig takes keywords only: positional arguments once put the host into triton_model."""

from __future__ import annotations

import pytest

from splitfuse.openai_api import ApiConfig


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        ApiConfig(".", "127.0.0.1:8001", "127.0.0.1", 9000)  # type: ignore[misc]


def test_keywords_land_in_their_fields():
    config = ApiConfig(model_dir=".", triton_grpc_url="127.0.0.1:8001", host="0.0.0.0", port=9100)
    assert (config.triton_model, config.host, config.port) == ("llm", "0.0.0.0", 9100)
