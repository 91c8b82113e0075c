"""`kvserve router`: an OpenAI-compatible front over several replicas, choosing one per request."""
