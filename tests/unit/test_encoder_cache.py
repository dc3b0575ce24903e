"""Encoder outputs are kept by content: a hit skips preprocessing and the encoder, in memory and on
disk across processes, never changes an answer, and a damaged or unusable disk only costs speed."""

import json
import logging
import os
import pickle
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import diskcache
import pytest
import torch

import omni_local.engine.forward.media_encoder as media_encoder
from samples import clip, picture
from omni_local.access import LOCAL_USER
from omni_local.api import OmniLocal
from omni_local.engine.memory.encoder_cache import BytesOnlyDisk
from omni_local.engine.prompt.builder import build_prompt
from omni_local.folders import keep_compiled_code_in
from omni_local.protocol.messages import Message

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8


PROMPTS = {
    "image": lambda: {"images": [picture(1)]},
    "audio": lambda: {"audio": [clip(2)]},
    "image and audio": lambda: {"images": [picture(3)], "audio": [clip(4)]},
}


def ask(app: OmniLocal, question: str, **media) -> list[int]:
    # A new session each time: nothing comes from the prefix cache (it is off in these apps anyway).
    return app.session("You look and listen.").send(question, max_new_tokens=NEW_TOKENS, **media).result().token_ids


@pytest.fixture
def settings(demo_settings, tmp_path):
    """Only the encoder cache on (the prefix cache would skip the encoders for its own reasons)."""
    return demo_settings.replace(prefix_cache=False, cache_dir=str(tmp_path / "cache"))


@pytest.fixture
def counted(monkeypatch):
    """Counts of preprocessing calls and encoder forwards."""
    counts = {"preprocess": 0, "vision": 0, "audio": 0}
    original = media_encoder.preprocess

    def preprocess(*args, **kwargs):
        counts["preprocess"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(media_encoder, "preprocess", preprocess)

    def count(app: OmniLocal) -> dict[str, int]:
        counts.update(dict.fromkeys(counts, 0))  # from here on: the start-up warm-up is not a request
        encoders = app.backend.engine.runner.encoder.encoders
        for name, method in (("vision", "images"), ("audio", "audio")):
            forward = getattr(encoders, method)

            def wrapped(*args, _forward=forward, _name=name, **kwargs):
                counts[_name] += 1
                return _forward(*args, **kwargs)

            monkeypatch.setattr(encoders, method, wrapped)
        return counts

    return count


@pytest.mark.parametrize("case", PROMPTS)
def test_answers_with_the_encoder_cache_equal_answers_without_it_in_memory_and_from_disk(settings, case):
    media = PROMPTS[case]()
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = [ask(off, "What is this?", **media), ask(off, "And now?", **media)]
    with OmniLocal(settings) as on:
        assert [ask(on, "What is this?", **media), ask(on, "And now?", **media)] == expected  # miss, then memory
    with OmniLocal(settings) as restarted:
        assert ask(restarted, "And now?", **media) == expected[1]  # from disk


def test_a_hit_runs_no_preprocessing_and_no_encoder(settings, counted):
    with OmniLocal(settings) as app:
        counts = counted(app)
        media = {"images": [picture(5)], "audio": [clip(6)]}
        ask(app, "First?", **media)
        assert counts == {"preprocess": 1, "vision": 1, "audio": 1}
        ask(app, "Second?", **media)
        assert counts == {"preprocess": 1, "vision": 1, "audio": 1}
        ask(app, "Third?", images=[picture(7)], **{"audio": media["audio"]})  # only the new image is encoded
        assert counts == {"preprocess": 2, "vision": 2, "audio": 1}


def test_cached_outputs_are_bit_identical_to_a_fresh_encode(settings):
    with OmniLocal(settings) as app:
        prompt = build_prompt([Message("user", [picture(8), clip(9), "What?"])], app.backend.loaded.processor)
        encoder = app.backend.engine.runner.encoder
        fresh = encoder._encode(prompt.media)
        ask(app, "What?", images=[picture(8)], audio=[clip(9)])
        for item, expected in zip(prompt.media, fresh):
            cached = app.backend.engine.encoder_cache.get(media_encoder.cache_key(item, LOCAL_USER))
            assert cached.keys() == expected.keys()
            assert all(torch.equal(cached[k], expected[k]) for k in expected)


RESTART_SCRIPT = """
import json, sys
sys.path.insert(0, "tests/support")
from samples import clip, picture
from omni_local.api import OmniLocal
from omni_local.settings import Settings

settings, media = Settings(**json.loads(sys.argv[1])), json.loads(sys.argv[2])
with OmniLocal(settings) as app:
    def refuse(*args, **kwargs):
        raise AssertionError("an encoder ran")
    app.backend.engine.runner.encoder.encoders.images = app.backend.engine.runner.encoder.encoders.audio = refuse
    reply = app.session("You look and listen.").send(
        "Again?", images=[picture(s) for s in media["images"]], audio=[clip(s) for s in media["audio"]],
        max_new_tokens=8,
    )
    print(json.dumps(reply.result().token_ids))
"""
SEEDS = {"image": {"images": [10], "audio": []}, "audio": {"images": [], "audio": [11]},
         "image and audio": {"images": [12], "audio": [13]}}


@pytest.mark.parametrize("case", SEEDS)
def test_a_second_process_answers_about_known_media_from_disk_without_any_encoder(settings, case):
    seeds = SEEDS[case]
    media = {"images": [picture(s) for s in seeds["images"]], "audio": [clip(s) for s in seeds["audio"]]}
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = ask(off, "Again?", **media)
    with OmniLocal(settings) as first:
        ask(first, "What is it?", **media)
    fields = {k: getattr(settings, k) for k in ("model", "demo_dir", "cache_dir", "device", "prefix_cache",
                                                "gpu_cache_bytes", "max_context_tokens", "max_prompt_tokens")}
    done = subprocess.run([sys.executable, "-c", RESTART_SCRIPT, json.dumps(fields), json.dumps(seeds)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_the_cache_folders_are_private_to_the_user(settings):
    with OmniLocal(settings):
        root = Path(settings.cache_dir).expanduser()
        for folder in (root, root / "encoders"):
            assert folder.stat().st_mode & 0o777 == 0o700


def test_compiled_code_is_kept_in_a_private_folder_of_the_app_unless_the_user_chose_one(tmp_path, monkeypatch):
    ours = tmp_path / "app" / "compiled"
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # so that whatever the test sets is undone afterwards
    for unchosen in (None, str(Path(tempfile.gettempdir()) / "torchinductor_someone")):  # unset, torch's default
        if unchosen is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", unchosen)
        monkeypatch.delenv("TRITON_CACHE_DIR")
        keep_compiled_code_in(ours)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
        # Triton's from the first kernel on, not from whenever inductor first builds one of its own
        assert os.environ["TRITON_CACHE_DIR"] == str(ours / "triton")
    assert ours.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    monkeypatch.delenv("TRITON_CACHE_DIR")
    keep_compiled_code_in(ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")
    assert "TRITON_CACHE_DIR" not in os.environ
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "their triton"))
    keep_compiled_code_in(ours)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "their triton")


# Faults -----------------------------------------------------------------------------------------


def warnings_from(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "encoder" in r.name]


def only_entry(folder: Path) -> str:
    with diskcache.Cache(str(folder), disk=BytesOnlyDisk) as cache:
        (key,) = list(cache.iterkeys())
        return key


def test_a_truncated_entry_is_dropped_with_one_warning_and_computed_again(settings, caplog, counted):
    image = picture(11)
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = ask(off, "What?", images=[image])
    with OmniLocal(settings) as app:
        ask(app, "What?", images=[image])
    folder = Path(settings.cache_dir) / "encoders"
    key = only_entry(folder)
    with diskcache.Cache(str(folder), disk=BytesOnlyDisk) as cache:
        cache.set(key, cache.get(key)[:100])
    with OmniLocal(settings) as app:
        counts = counted(app)
        assert ask(app, "What?", images=[image]) == expected
        assert counts["vision"] == 1  # recomputed
        assert ask(app, "What?", images=[image]) == expected
    assert len([w for w in warnings_from(caplog) if "damaged entry" in w]) == 1


class _Marker:
    unpickled = False

    def __reduce__(self):
        return (_mark_unpickled, ())


def _mark_unpickled() -> "_Marker":
    _Marker.unpickled = True
    return _Marker()


def test_a_pickled_value_on_disk_is_never_unpickled(settings, caplog):
    image = picture(12)
    with OmniLocal(settings) as app:
        expected = ask(app, "What?", images=[image])
    folder = Path(settings.cache_dir) / "encoders"
    key = only_entry(folder)
    with diskcache.Cache(str(folder)) as cache:  # a plain diskcache pickles what is not bytes
        cache.set(key, _Marker())
    assert pickle.loads(pickle.dumps(_Marker())) and _Marker.unpickled  # the payload does mark when unpickled
    _Marker.unpickled = False
    with OmniLocal(settings) as app:
        assert ask(app, "What?", images=[image]) == expected
    assert not _Marker.unpickled
    assert any("damaged entry" in w for w in warnings_from(caplog))


def test_a_size_limit_smaller_than_one_entry_warns_once_and_answers_stay_right(settings, caplog):
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = [ask(off, "What?", images=[picture(s)]) for s in (13, 14)]
    with OmniLocal(settings.replace(disk_cache_bytes=1000)) as app:
        assert [ask(app, "What?", images=[picture(s)]) for s in (13, 14)] == expected
    assert len([w for w in warnings_from(caplog) if "over disk_cache_bytes" in w]) == 1


NOT_A_DATABASE = b"this is not an SQLite database" * 100


def test_a_corrupt_database_at_start_is_deleted_with_one_warning_and_the_rebuilt_one_used_at_the_next_start(
        settings, caplog, counted):
    folder = Path(settings.cache_dir) / "encoders"
    folder.mkdir(mode=0o700, parents=True)  # private, as the app's own folders must be
    (folder / "cache.db").write_bytes(NOT_A_DATABASE)
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = ask(off, "What?", images=[picture(15)])
    with OmniLocal(settings) as app:
        assert app.backend.engine.encoder_cache.disk_enabled
        assert ask(app, "What?", images=[picture(15)]) == expected
    with OmniLocal(settings) as restarted:
        counts = counted(restarted)
        assert ask(restarted, "What?", images=[picture(15)]) == expected
        assert counts["vision"] == 0  # read from the rebuilt database's entry
    assert warnings_from(caplog) == [
        f"encoder disk cache: the database in {folder} is damaged (file is not a database): deleted it and its "
        "entries; the disk cache starts again empty"]


def damage_the_entries_table(database: Path) -> None:
    """Overwrite the page at the root of diskcache's table of entries: the database still opens, and
    the first read of an entry finds it malformed."""
    with closing(sqlite3.connect(database)) as connection:
        (root,) = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = 'Cache'").fetchone()
        (page_size,) = connection.execute("PRAGMA page_size").fetchone()
    with open(database, "r+b") as file:
        file.seek((root - 1) * page_size)
        file.write(b"\xff" * page_size)


def test_a_database_found_damaged_while_serving_is_rebuilt_with_one_warning_and_used_at_the_next_start(
        settings, caplog, counted):
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = [ask(off, "What?", images=[picture(s)]) for s in (21, 22)]
    with OmniLocal(settings) as app:
        ask(app, "What?", images=[picture(21)])
    folder = Path(settings.cache_dir) / "encoders"
    damage_the_entries_table(folder / "cache.db")
    with OmniLocal(settings) as app:
        assert [ask(app, "What?", images=[picture(s)]) for s in (21, 22)] == expected
        assert app.backend.engine.encoder_cache.disk_enabled
    with OmniLocal(settings) as restarted:
        counts = counted(restarted)
        assert [ask(restarted, "What?", images=[picture(s)]) for s in (21, 22)] == expected
        assert counts["vision"] == 0  # both from the rebuilt database
    assert warnings_from(caplog) == [
        f"encoder disk cache: the database in {folder} is damaged (database disk image is malformed): deleted it "
        "and its entries; the disk cache starts again empty"]


def test_a_disk_that_fills_up_turns_the_disk_tier_off_with_one_warning(settings, mountable, caplog):
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = [ask(off, "What?", images=[picture(s)]) for s in (16, 17, 18)]
    with OmniLocal(settings.replace(cache_dir=str(mountable))) as app:
        assert ask(app, "What?", images=[picture(16)]) == expected[0]
        with open(mountable / "filler", "wb") as filler:  # take every byte left
            try:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            except OSError:
                pass
        assert ask(app, "What?", images=[picture(17)]) == expected[1]
        assert ask(app, "What?", images=[picture(18)]) == expected[2]
        assert not app.backend.engine.encoder_cache.disk_enabled
    assert len([w for w in warnings_from(caplog) if "turned off" in w]) == 1


def test_a_read_only_folder_at_start_turns_the_disk_tier_off_with_one_warning(settings, mountable, caplog):
    subprocess.run(["mount", "-o", "remount,ro", str(mountable)], check=True)
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = ask(off, "What?", images=[picture(19)])
    with OmniLocal(settings.replace(cache_dir=str(mountable))) as app:
        assert not app.backend.engine.encoder_cache.disk_enabled
        assert ask(app, "What?", images=[picture(19)]) == expected
    assert len([w for w in warnings_from(caplog) if "turned off" in w]) == 1


def test_the_start_up_warm_up_leaves_nothing_in_any_cache(settings):
    with OmniLocal(settings.replace(prefix_cache=True)) as app:
        assert app.backend.engine.encoder_cache.memory_bytes == 0
        assert app.backend.engine.cache.entries == {}
        assert app.backend.engine.runner.kv.pool.free == app.backend.engine.runner.kv.pool.usable


def test_a_cached_output_of_the_wrong_shape_is_not_used(settings, counted):
    image = picture(20)
    with OmniLocal(settings.replace(encoder_cache=False)) as off:
        expected = ask(off, "What?", images=[image])
    with OmniLocal(settings) as app:
        counts = counted(app)
        item = build_prompt([Message("user", [image, "What?"])], app.backend.loaded.processor).media[0]
        hidden = app.backend.loaded.model.thinker.config.text_config.hidden_size
        wrong = {"embeds": torch.zeros(3, hidden), "grid": torch.tensor([1, 2, 6])}
        app.backend.engine.encoder_cache.put(media_encoder.cache_key(item, LOCAL_USER), wrong)
        assert ask(app, "What?", images=[image]) == expected
        assert counts["vision"] == 1


def test_with_compiled_encoders_the_app_answers_as_with_eager_ones(settings):
    media = {"images": [picture(21)], "audio": [clip(22)]}
    with OmniLocal(settings.replace(encoder_cache=False)) as eager:
        expected = ask(eager, "What is this?", **media)
    with OmniLocal(settings.replace(encoder_cache=False, compile=True)) as compiled:
        assert compiled.backend.engine.runner.encoder.encoders.compiled
        assert ask(compiled, "What is this?", **media) == expected
