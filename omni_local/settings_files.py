"""settings.toml and docs/settings.md, written from the Settings fields, so each help text is
written once (in settings.py) and the files cannot drift from it; tests/unit/test_settings.py checks
that the shipped files are what this module writes.

    python -m omni_local.settings_files    # rewrites both after a field or its help changed
"""

import json
import textwrap
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from omni_local.settings import DEFAULT_SETTINGS_FILE, Settings, expected_values

SETTINGS_PAGE = DEFAULT_SETTINGS_FILE.parent / "docs" / "settings.md"
REGENERATE = "python -m omni_local.settings_files"
WIDTH = 100
TOML_HEADER = f"""\
# omni_local settings (this file holds the defaults). Every key can also be given on the command
# line: --max-new-tokens 64. Unknown keys and values of the wrong type are refused, naming the key.
# Written by `{REGENERATE}` from the help in omni_local/settings.py.
"""
PAGE_HEADER = f"""\
# Settings

<!-- Written by `{REGENERATE}` from omni_local/settings.py: edit the help there. -->

`settings.toml` holds every setting with its default; each can be overridden on the command line by
name (`--max-new-tokens 64`, `--ui-port 8000`, `--settings other.toml`). An unknown key, a key in
another table than its own, or a value of the wrong type is refused with a message naming it. Key
names are unique across tables, so the command line needs no table.
"""


def settings_toml() -> str:
    """The shipped settings file: every key at its default, under its help as comment lines."""
    return TOML_HEADER + "".join(_toml_section(table, entries) for table, entries in _tables().items())


def settings_page() -> str:
    """docs/settings.md: a section per settings table, a row per key: its default, values and help."""
    return PAGE_HEADER + "".join(_page_section(table, entries) for table, entries in _tables().items())


def _tables() -> dict[str, list[Field]]:
    """The fields by table, tables and keys in the order the dataclass declares them."""
    tables: dict[str, list[Field]] = {}
    for f in fields(Settings):
        tables.setdefault(f.metadata["table"], []).append(f)
    return tables


def _toml_section(table: str, entries: list[Field]) -> str:
    return f"\n[{table}]\n" + "\n\n".join(_toml_entry(f) for f in entries) + "\n"


def _toml_entry(f: Field) -> str:
    comment = textwrap.wrap(f.metadata["help"], WIDTH - 2, break_on_hyphens=False)
    return "".join(f"# {line}\n" for line in comment) + f"{f.name} = {_toml_value(f.default)}"


def _toml_value(value: Any) -> str:
    # JSON's strings, numbers and booleans are TOML's too (a float keeps its '.0').
    return json.dumps(value)


def _page_section(table: str, entries: list[Field]) -> str:
    rows = "".join(_page_row(f) + "\n" for f in entries)
    return f"\n## [{table}]\n\n| key | default | values | meaning |\n| --- | --- | --- | --- |\n{rows}"


def _page_row(f: Field) -> str:
    default = f"`{_toml_value(f.default)}`" + _readable_size(f.name, f.default)
    return f"| `{f.name}` | {default} | {expected_values(f.type)} | {_markdown_text(f.metadata['help'])} |"


def _readable_size(name: str, value: Any) -> str:
    """' (4 GiB)' beside a byte count that is a whole number of MiB or GiB; else nothing."""
    if not name.endswith("_bytes") or value <= 0:
        return ""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if value % size == 0:
            return f" ({value // size} {unit})"
    return ""


def _markdown_text(text: str) -> str:
    # '<cache_dir>' would be read as an HTML tag, and '|' would end the table's cell.
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def main() -> None:
    DEFAULT_SETTINGS_FILE.write_text(settings_toml(), encoding="utf-8")
    SETTINGS_PAGE.write_text(settings_page(), encoding="utf-8")
    print(f"wrote {DEFAULT_SETTINGS_FILE} and {SETTINGS_PAGE}")


if __name__ == "__main__":
    main()
