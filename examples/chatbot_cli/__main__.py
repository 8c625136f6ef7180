"""``python -m examples.chatbot_cli``: start the terminal chat (see chat.py)."""

import sys

from examples.chatbot_cli.chat import main

sys.exit(main())
