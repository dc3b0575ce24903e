"""Start the chat UI: `python app.py` (demo model unless settings.toml names a checkpoint).

Binds 127.0.0.1 by default; every setting can be overridden, e.g. `python app.py --ui-port 8000`.
"""

import argparse
import sys

from omni_local.errors import OmniLocalError
from omni_local.model.loader import quiet_library_logs
from omni_local.settings import add_settings_arguments, settings_from_arguments


def main() -> int:
    parser = argparse.ArgumentParser(description="omni_local chat UI")
    add_settings_arguments(parser)
    quiet_library_logs()
    try:
        settings = settings_from_arguments(parser.parse_args())
        from omni_local.api import OmniLocal
        from omni_local.ui.chat import build_ui

        app = OmniLocal(settings)
    except OmniLocalError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ui = build_ui(app)
    ui.launch(server_name=settings.ui_host, server_port=settings.ui_port, max_file_size=settings.max_upload_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
