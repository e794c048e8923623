"""``python -m stepbundle`` is the ``stepbundle`` command."""

import sys

from stepbundle.cli import main

sys.exit(main())
