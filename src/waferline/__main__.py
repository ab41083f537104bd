"""`python -m waferline ...`: the `waferline` command."""

import sys

from waferline.cli import main

sys.exit(main())
