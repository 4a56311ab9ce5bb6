"""``python -m broker.cli``: the same as the ``mqlog`` command."""

import sys

from broker.cli import main

sys.exit(main())
