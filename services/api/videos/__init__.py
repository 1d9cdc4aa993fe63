"""``/v1/videos``: OpenAI's videos API over vidq's jobs."""
