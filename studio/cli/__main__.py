"""``python -m studio.cli``: the same as the ``omni-studio`` console script."""

import sys

from studio.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
