"""Terminal chat (``python -m examples.chatbot_cli``)."""
