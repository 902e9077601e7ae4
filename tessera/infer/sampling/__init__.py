"""Turning logits into tokens: a request's `SamplingParams` (params.py), temperature / top-k / top-p
on the host and on the device (sampler.py, device_sampling.py), penalties, log-probabilities, and
output constrained by a JSON schema or a grammar (structured_output.py, response_format.py).
"""
