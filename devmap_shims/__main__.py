import sys

from devmap_shims.cli import main

sys.exit(main())
