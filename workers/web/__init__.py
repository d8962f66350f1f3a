"""The worker HTTP surface's parts (docs/design.md §4.3, docs/wire.md): OpenAI completions
(completions.py), models and the tokenizer routes (models.py), how a request becomes
token ids and which fields are refused (prompts.py), the /kv/* endpoints (kv.py),
operations (ops.py), the generation response (stream.py) and what they share
(common.py). workers/app.py assembles them on FastAPI."""
