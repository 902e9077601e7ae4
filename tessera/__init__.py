"""Tessera: train and serve dense and Mixture-of-Experts language models."""

__version__ = "0.1.0"
