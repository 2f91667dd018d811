"""HTTP API: OpenAI-compatible and native routes over an `EngineClient`."""

# Where `specserve serve` and the ingress read the API key when none is configured. Here, not in
# `auth`, so the CLI can name it without importing the HTTP stack (`specserve bench` runs without it).
API_KEY_ENV = "SPECSERVE_API_KEY"
