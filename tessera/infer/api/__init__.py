"""The HTTP side of one model: the OpenAI-compatible server (server.py) with its request protocol,
choices and log-probabilities (openai_*.py), the Responses and Anthropic Messages APIs, the guards
every request passes (http_guards.py), image fetches (media.py), quoting of client values in errors
(quoting.py), and the sleep and profile routes. Several models behind one server and `tessera router`
are `infer/fleet/`.
"""
