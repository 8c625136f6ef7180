"""Runnable examples (run from the repository root: ``python -m examples.chatbot_cli``, ...)."""
