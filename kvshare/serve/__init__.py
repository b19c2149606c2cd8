"""The replica's OpenAI-compatible HTTP server, a module per job: schema, validation, bridge (engine thread ->
asyncio), pieces (token ids -> text), formats (SSE or whole bodies), metrics, app, and `kvshare serve` (cli.py)."""
