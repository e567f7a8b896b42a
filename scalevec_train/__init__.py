"""scalevec: pre-training dense and MoE decoders with the scale-vector strategies of arXiv
2605.26895."""


def __getattr__(name: str):
    # `import scalevec_train` stays light: torch, DCP and the model load on first use of load().
    if name == "load":
        from scalevec_train.interop.api import load

        return load
    raise AttributeError(f"module 'scalevec_train' has no attribute {name!r}")
