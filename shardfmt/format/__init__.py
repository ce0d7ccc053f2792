"""The format layer: pure bytes <-> records (manifest records and parse, safetensors header,
hashing, dtypes, typed JSON). Imports nothing above it; no I/O."""
