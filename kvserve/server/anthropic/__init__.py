"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): a translation
of Anthropic's request onto the chat pipeline (``kvserve/server/chat_pipeline.py``) and of its
outputs back into Anthropic's message, events and errors."""
