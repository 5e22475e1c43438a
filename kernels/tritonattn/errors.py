"""The exceptions the public functions raise for bad input, before any kernel launches.

flash-attn raises RuntimeError for the inputs it rejects; Python code expects ValueError and TypeError.
These classes are both, so code written against either catches ours.
"""

from __future__ import annotations


class InputError(ValueError, RuntimeError):
    """An input with the wrong shape, device, length or value."""


class InputTypeError(TypeError, RuntimeError):
    """An input of the wrong type or dtype."""
