"""HTTP API: OpenAI-compatible and native routes over an `EngineClient`."""
