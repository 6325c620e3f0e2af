"""fedpool's face: the `fedpool` CLI and the embedded local pool. Imports every room; nothing imports it."""

__version__ = "0.1.0"
