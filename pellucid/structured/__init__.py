"""Structured outputs: a request's tokens held to a JSON schema, a regex, a list of choices or a grammar."""
from pellucid.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
