"""Start the chat UI: `python app.py` (demo model unless settings.toml names a checkpoint).

Binds 127.0.0.1 by default; every setting can be overridden, e.g. `python app.py --ui-port 8000`.
Serving beyond this machine needs `--ui-host ADDRESS --ui-credentials-file FILE` (see ui/access.py).
`--ui-serves-api true` also serves the OpenAI-compatible API (omni_local/server) at /v1 on the
page's port and engine; beyond this machine it needs `--api-key-file FILE` too.
"""

import argparse
import sys

from omni_local.access import api_keys
from omni_local.errors import OmniLocalError
from omni_local.folders import keep_new_files_private
from omni_local.listening import listening
from omni_local.server.header_timeout import use_for_the_page
from omni_local.settings import add_settings_arguments, settings_from_arguments
from omni_local.ui.access import keep_uploads_private, launch_options


def main() -> int:
    parser = argparse.ArgumentParser(description="omni_local chat UI")
    add_settings_arguments(parser)
    try:
        settings = settings_from_arguments(parser.parse_args())
        options = launch_options(settings)  # refused before the model loads
        # A port in use is refused before the model loads too, and held while it loads, so a second
        # app started meanwhile is refused at once; Gradio binds it itself, once it is let go.
        reserved = listening(settings.ui_host, settings.ui_port, "ui_host, ui_port")
        keys = api_keys(settings, "ui_host") if settings.ui_serves_api else None
        keep_uploads_private(settings)
        from omni_local.api import OmniLocal
        from omni_local.ui.chat import build_ui
        from omni_local.ui.page_style import launch_style

        app = OmniLocal(settings, wait_for_graphs=False)
        print(f"omni_local: {app.info.describe()}", flush=True)
        ui = build_ui(app)
    except OmniLocalError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if settings.ui_serves_api:
        from omni_local.server.routes import api_mount

        # Gradio's app is made by launch(); routes given to it first are matched before Gradio's own, and
        # Gradio's auth (its routes' dependencies) and upload limit stay on the page's routes alone.
        options["app_kwargs"]["routes"] = [api_mount(app, keys)]
    use_for_the_page(settings.header_timeout_s)  # Gradio starts the page's server itself
    reserved.close()
    ui.launch(**options, **launch_style())
    return 0


if __name__ == "__main__":
    keep_new_files_private()
    sys.exit(main())
