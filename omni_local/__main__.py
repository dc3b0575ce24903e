import sys

from omni_local.cli import main
from omni_local.folders import keep_new_files_private

keep_new_files_private()
sys.exit(main())
