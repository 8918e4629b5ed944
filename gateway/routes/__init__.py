"""HTTP routes, one module per surface: OpenAI (`/v1`), admin (`/admin`), vLLM's adapter endpoints, health."""
