"""`python -m hypafilter` runs the CLI."""

import sys

from hypafilter.cli import main

sys.exit(main())
