"""slabserve's serving runtime. `from runtime import Engine` is the Python API (loaded lazily, so that the pure-Python
scheduler and slab allocator import without torch)."""


def __getattr__(name: str):
    if name in ("Engine", "EngineConfig", "StoppingOptions"):
        from slabserve.runtime import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
