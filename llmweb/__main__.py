"""`python -m llmweb ...`: see cli/main.py."""

import sys

from llmweb.cli.main import main

sys.exit(main())
