"""OpenAI-compatible HTTP server: FastAPI app over one AsyncLLM (`kvserve serve`)."""
