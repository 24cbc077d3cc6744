"""The OpenAI-compatible HTTP gateway (see main.py)."""
