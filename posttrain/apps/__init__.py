"""The applications built on the engine: the command line, the warm-up of the embedded model, `compare` and
`estimate`. Nothing below this layer imports from it."""
