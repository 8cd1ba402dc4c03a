"""Integrations with other libraries' models; each lives apart from the op and only calls it.

``transformers``: :func:`posenc_fast.patch_model` for Hugging Face models with a sinusoidal PE.
"""
