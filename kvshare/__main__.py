"""`python -m kvshare ...` is the `kvshare` command."""

import sys

from kvshare.cli import main

sys.exit(main())
