import sys

from omni_local.cache.folders import keep_new_files_private
from omni_local.cli import main

keep_new_files_private()
sys.exit(main())
