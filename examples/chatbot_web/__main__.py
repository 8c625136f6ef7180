"""``python -m examples.chatbot_web``: start the web chat (see app.py)."""

from examples.chatbot_web.app import main

main()
