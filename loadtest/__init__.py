"""Load-test tools: trace replay and synthetic load over the OpenAI API."""
