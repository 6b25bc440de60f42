"""The captures of kerasdbg, one package per Keras backend.

Each implements `kerasdbg.capture.Capture` for the models of its backend:
`kerasdbg.backends.<name>.engine.engine_for(model)`, chosen once from
`keras.config.backend()` by `kerasdbg.capture.engine_for`, and the array
functions of `kerasdbg.quantities.ops` (`kerasdbg.backends.<name>.ops`).
Nothing outside the backends imports a framework or a backend directly.
"""
