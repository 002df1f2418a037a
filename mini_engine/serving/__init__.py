"""The OpenAI-compatible server (FastAPI + uvicorn) and its load generator (chapter 09)."""
