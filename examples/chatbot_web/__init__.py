"""Gradio web chat with kept-token highlighting (``python -m examples.chatbot_web``)."""
