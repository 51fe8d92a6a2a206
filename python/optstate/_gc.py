"""Python's cyclic garbage collector paused while a checkpoint is saved, loaded or read."""
import functools
import gc


def gc_paused(fn):
    """Runs ``fn`` with the cyclic collector off (as it was after). Saving or loading a model of many
    params builds hundreds of thousands of small objects (names, tuples, dicts, tensors), none of
    them in a cycle; each 700 of them start a collection, and the older generations hold the whole
    model: 30,000 params' load spent a fifth of its time in the collector (bench_many_params.py).
    Objects are freed by their counts as before; cycles made meanwhile wait for the next collection."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return paused
