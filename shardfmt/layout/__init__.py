"""The layout layer: pure element-space math (geometry, tiling, topology and placements, the
DTensor adapter, placement rules, state-dict flattening). Imports only the format below it."""
