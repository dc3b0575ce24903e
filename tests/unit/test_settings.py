import argparse
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from omni_local.errors import SettingsError
from omni_local.settings import (
    DEFAULT_SETTINGS_FILE,
    Settings,
    add_settings_arguments,
    load_settings,
    settings_from_arguments,
)
from omni_local.settings_files import REGENERATE, SETTINGS_PAGE, settings_page, settings_toml


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return path


def parse(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_from_arguments(parser.parse_args(argv))


def test_the_shipped_settings_file_holds_the_defaults():
    assert load_settings(DEFAULT_SETTINGS_FILE) == Settings()


def test_the_shipped_settings_file_is_the_one_written_from_the_fields():
    assert DEFAULT_SETTINGS_FILE.read_text(encoding="utf-8") == settings_toml(), f"run `{REGENERATE}`"


def test_the_settings_page_is_the_one_written_from_the_fields():
    assert SETTINGS_PAGE.read_text(encoding="utf-8") == settings_page(), f"run `{REGENERATE}`"


def test_the_written_settings_file_holds_each_key_under_its_help_in_its_table():
    text = settings_toml()
    lines = text.split("\n")
    for f in fields(Settings):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{f.name} = "))
        comment = []
        while lines[at - 1 - len(comment)].startswith("# "):
            comment.insert(0, lines[at - 1 - len(comment)].removeprefix("# "))
        assert " ".join(comment) == f.metadata["help"], f.name
    document = tomllib.loads(text)
    assert {key: table for table, keys in document.items() for key in keys} == {
        f.name: f.metadata["table"] for f in fields(Settings)
    }


def test_the_settings_page_gives_each_key_its_default_values_and_help():
    page = settings_page()
    helps = {f.name: f.metadata["help"] for f in fields(Settings)}
    assert "\n## [cache]\n" in page
    assert f"| `gpu_cache_bytes` | `4294967296` (4 GiB) | an integer | {helps['gpu_cache_bytes']} |\n" in page
    assert f"| `weights` | `\"bf16\"` | one of 'bf16', 'fp8', 'int4' | {helps['weights']} |\n" in page
    assert "| `demo_dir` | `\"\"` | a string | where the demo model is written; '' is &lt;cache_dir&gt;/demo |\n" in page


def test_the_defaults_run_the_demo_model_on_loopback():
    settings = Settings()
    assert settings.model == "demo"
    assert settings.ui_host == "127.0.0.1"


def test_a_file_sets_values_in_their_tables(tmp_path):
    path = write(tmp_path, '[model]\nmodel = "/ckpt"\n[engine]\nmax_new_tokens = 7\n[limits]\nmax_audio_seconds = 2\n')
    settings = load_settings(path)
    assert (settings.model, settings.max_new_tokens, settings.max_audio_seconds) == ("/ckpt", 7, 2)


def test_an_unknown_key_is_an_error_naming_it(tmp_path):
    path = write(tmp_path, "[engine]\nmax_new_tokenz = 7\n")
    with pytest.raises(SettingsError, match="unknown setting 'engine.max_new_tokenz'"):
        load_settings(path)


def test_a_key_in_the_wrong_table_is_an_error_naming_the_right_one(tmp_path):
    path = write(tmp_path, "[ui]\nmax_new_tokens = 7\n")
    with pytest.raises(SettingsError, match=r"'max_new_tokens' belongs in \[engine\]"):
        load_settings(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('[engine]\nmax_new_tokens = "many"', "'max_new_tokens' must be an integer, got 'many'"),
        ("[model]\nspeech = 1", "'speech' must be true or false, got 1"),
        ('[model]\ndtype = "int4"', "'dtype' must be one of 'auto', 'float32', 'bfloat16', 'float16'"),
        ("[ui]\nui_port = 0", "'ui_port' must be positive"),
        ("[ui]\nui_port = 70000", "'ui_port' must be a port number, 1 to 65535, got 70000"),
        ("[engine]\nprefill_forward_tokens = 1000",
         r"'prefill_forward_tokens' \(1000\) must be a multiple of 'prefill_chunk_tokens' \(512\)"),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_saying_what_was_expected(tmp_path, line, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(write(tmp_path, line + "\n"))


@pytest.mark.parametrize(("dtype", "least"), [("auto", 32768), ("bfloat16", 32768), ("float32", 65536)])
def test_a_gpu_cache_too_small_for_one_conversation_of_any_model_is_refused(dtype, least):
    # 8,192 tokens, each a key and a value of 2 bytes (bfloat16, which 'auto' may pick) or 4, at the least
    with pytest.raises(SettingsError, match=rf"'gpu_cache_bytes' \(1\) is below the {least:,} bytes that one"):
        Settings(gpu_cache_bytes=1, dtype=dtype)
    with pytest.raises(SettingsError, match="gpu_cache_bytes"):
        Settings(gpu_cache_bytes=least - 1, dtype=dtype)
    assert Settings(gpu_cache_bytes=least, dtype=dtype).gpu_cache_bytes == least


def test_invalid_toml_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path, "[engine\n")
    with pytest.raises(SettingsError, match="is not valid TOML"):
        load_settings(path)


def test_every_setting_can_be_overridden_on_the_command_line(tmp_path):
    path = write(tmp_path, "[engine]\nmax_new_tokens = 7\n")
    settings = parse(["--settings", str(path), "--max-new-tokens", "9", "--speech", "true", "--ui-port", "8001"])
    assert (settings.max_new_tokens, settings.speech, settings.ui_port) == (9, True, 8001)


def test_a_bad_command_line_value_is_an_error_naming_the_setting():
    with pytest.raises(SettingsError, match="'gpu_cache_bytes' must be an integer, got 'lots'"):
        parse(["--gpu-cache-bytes", "lots"])


def test_the_demo_model_lives_in_the_cache_folder_unless_placed_elsewhere():
    assert Settings(cache_dir="/data/omni").demo_path == Path("/data/omni/demo")
    assert Settings(demo_dir="/elsewhere").demo_path == Path("/elsewhere")
