"""The settings come in groups, one per table, by who reads them; the engine is given its groups alone."""

from dataclasses import fields

import pytest

from omni_local.errors import SettingsError
from omni_local.protocol.events import ContextUse
from omni_local.settings import (
    BackendSettings,
    CacheSettings,
    EngineConfig,
    EngineSettings,
    LimitSettings,
    ModelSettings,
    ServerSettings,
    Settings,
    SpeechSettings,
    UISettings,
)

GROUPS = {
    ModelSettings: "model", EngineSettings: "engine", SpeechSettings: "speech", CacheSettings: "cache",
    UISettings: "ui", ServerSettings: "server", BackendSettings: "backend", LimitSettings: "limits",
}


def tables(settings_type: type) -> set[str]:
    return {f.metadata["table"] for f in fields(settings_type)}


def test_each_group_declares_the_keys_of_its_own_table():
    for group, table in GROUPS.items():
        assert tables(group) == {table}, group.__name__


def test_the_whole_settings_are_the_groups_keys_each_once_in_the_tables_order():
    assert [f.name for f in fields(Settings)] == [f.name for group in GROUPS for f in fields(group)]


def test_the_engine_config_holds_the_model_engine_speech_and_cache_tables_and_nothing_else():
    assert tables(EngineConfig) == {"model", "engine", "speech", "cache"}
    engine = Settings().for_engine()
    assert type(engine) is EngineConfig
    for elsewhere in ("ui_port", "api_key_file", "backend_url", "max_upload_bytes", "max_prompt_tokens"):
        assert not hasattr(engine, elsewhere), elsewhere


def test_the_engine_config_keeps_every_value_of_its_groups_from_the_whole_settings():
    whole = Settings(weights="int4", max_new_tokens=7, voice="Chelsie", kv_block_tokens=32, ui_port=8001)
    engine = whole.for_engine()
    assert {f.name: getattr(engine, f.name) for f in fields(EngineConfig)} == {
        f.name: getattr(whole, f.name) for f in fields(EngineConfig)
    }
    assert engine.cache_path == whole.cache_path and engine.demo_path == whole.demo_path


def test_a_key_of_another_group_cannot_be_set_on_the_engine_config():
    with pytest.raises(SettingsError, match="unknown setting 'ui_port'"):
        Settings().for_engine().replace(ui_port=8001)
    assert Settings().for_engine().replace(max_new_tokens=9).max_new_tokens == 9


@pytest.mark.parametrize(
    ("group", "values", "message"),
    [
        (EngineConfig, {"max_context_tokens": 0}, "'max_context_tokens' must be positive"),
        (EngineConfig, {"gpu_cache_bytes": 1}, r"'gpu_cache_bytes' \(1\) is below"),
        (CacheSettings, {"kv_block_tokens": 24}, "'kv_block_tokens' must be a power of two"),
        (ServerSettings, {"api_port": 70000}, "'api_port' must be a port number"),
        (LimitSettings, {"max_prompt_tokens": 0}, "'max_prompt_tokens' must be positive"),
        (BackendSettings, {"backend": "openai"}, "set 'backend_url'"),
    ],
)
def test_each_group_checks_its_own_values_when_made_alone(group, values, message):
    with pytest.raises(SettingsError, match=message):
        group(**values)


def test_the_local_backend_hands_the_engine_its_groups_and_the_prompt_limit_apart(app, demo_settings):
    engine = app.backend.engine
    assert type(engine.settings) is EngineConfig
    final = app.session().send("Hello", max_new_tokens=2).result()
    assert final.context == ContextUse(demo_settings.max_context_tokens, demo_settings.max_prompt_tokens)
