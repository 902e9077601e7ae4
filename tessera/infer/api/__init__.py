"""The HTTP side: the OpenAI-compatible server (server.py) with its request protocol, choices and
log-probabilities (openai_*.py), the guards every request passes (http_guards.py), image fetches
(media.py), quoting of client values in errors (quoting.py), several models behind one server, awake
or asleep within a memory budget (model_registry.py, multi_model_app.py), and `tessera router` in
front of a prefill and a decode instance (router.py, router_relay.py) or of replicas
(replica_router.py, prefix_index.py).
"""
