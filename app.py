"""Launch the llmweb web app: `python app.py` (also the Hugging Face Spaces entry point).

Settings come from LLMWEB_* environment variables (docs/configuration.md). Nothing heavy
happens at import: the model loads in the background once the server is up.
"""

import sys

from llmweb.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
