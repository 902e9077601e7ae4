"""Serving beyond one model on one server: several models behind one server, awake or asleep within a
memory budget (model_registry.py keeps them, model_adapters.py the LoRA adapters each serves,
multi_model_app.py routes each request to its model's app), and `tessera router` in front of a
prefill and a decode instance (router.py, with the relay, deadlines and error bodies it shares with
the replica router in router_relay.py) or of replicas of the same models (replica_router.py;
prefix_index.py: what it sent where). Each speaks to the one-model servers of `infer/api/` over HTTP
or wraps their apps; nothing in `infer/api/` imports it.
"""
