"""VQ image tokenizers, text tokenizers, and the shared vocabulary layout.

Import the modules themselves (``tokenizers.registry``, ``tokenizers.vocab``, ...): the
package imports nothing, so reading a manifest's vocabulary layout (``vocab.py``) does not
pull in torch and transformers.
"""
