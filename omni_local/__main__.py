import sys

from omni_local.cli import main

sys.exit(main())
