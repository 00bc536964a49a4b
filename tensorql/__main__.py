"""``python -m tensorql``: the ``tensorql`` command line (:func:`tensorql.cli.main`) for a
checkout that is not pip-installed (no console script on PATH).

    python -m tensorql sql "SELECT 42 AS answer"
"""

from __future__ import annotations

import sys

from tensorql.cli import main

if __name__ == "__main__":
    sys.exit(main())
