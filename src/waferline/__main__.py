"""`python -m waferline ...`: the `waferline` command."""

import sys

try:
    from waferline.cli import main
except KeyboardInterrupt:  # (Ctrl-C while the command line itself imports: no traceback)
    print("interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
