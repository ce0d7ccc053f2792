"""The package version (the bottom of the stack: the writer records it in every manifest)."""

__version__ = "0.1.0"
